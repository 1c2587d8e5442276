"""Build a tiny vision-language model, for jobs whose rows carry images and for their tests: an
``Idefics3ForConditionalGeneration`` (the one vision-language architecture vLLM's CPU build runs
here without torchvision) that has learned something only the image decides, so that a test can
tell an image that reached the model from one dropped, swapped or sent to the wrong row.

The task: synthetic 32x32 RGB pictures, a solid background of one of six colours with one shape
(square, circle or triangle) of another colour on it, its size and place random; the questions
ask the background's colour, the shape's colour or the shape, in a few phrasings each (so the
text decides what is asked and the image what the answer is), answered with one word and then
``<end_of_utterance>``. Trained from scratch on pictures drawn here, every weight: the vision
tower (2 layers, hidden 128, 8x8 patches: 16 per picture), the connector (Idefics3's pixel
shuffle, scale factor 2: 4 image tokens per picture) and a small Llama (2 layers, hidden 128, 2
heads of head_dim 64: vLLM's CPU attention takes no smaller head). The build checks HF greedy
answers on held-out pictures (another seed: other places, sizes, colour pairs), over three
question kinds: at least :data:`MIN_ACCURACY` right, or it fails and leaves the old directory as
it was. Right answers across colours and shapes mean that the answer follows the picture.

The tokenizer is the tiny target's (``--target``: its byte-level BPE, no model weights) with
Idefics3's tokens added (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<end_of_utterance>``, the end of a turn and so the end of generation) and ``<|begin_of_text|>``,
which the chat template writes: the tokenizer adds no token of its own, so a prompt encodes the
same with or without special tokens. The chat template is Idefics3's form,
``<|begin_of_text|>User:<image>What shape is it?<end_of_utterance>\\nAssistant:`` (content as a
string or a list of ``image`` and ``text`` parts), saved where transformers' processor and vLLM
read it. The processor does not split pictures (``do_image_splitting`` off, longest edge 32):
one picture is 7 prompt tokens (4 of them ``<image>``).

On disk: the model's weights and config, the tokenizer, the processor's files, the chat
template, ``batchspec-model.json`` (what was built, the check) and the ``.batchspec-complete``
stamp (built beside the directory and renamed into place). Deterministic (seeded, one thread).
Usage: ``python tools/tiny_vlm.py [--target .models/target] [--out .models/vlm]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grow_model import COMPLETE_MARKER, file_sha256, is_current, publish, scratch_dir  # noqa: E402

from batchspec.distill.recipe import lr_at  # noqa: E402

SEED = 2718
HELD_OUT_SEED = 31415
IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 4
#: <image> tokens per picture: (32 / 8) ** 2 patches, pixel-shuffled by 2 x 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 40),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
}
SHAPES = ("square", "circle", "triangle")
#: What is asked, in a few phrasings each; the answer is the picture's background colour, its
#: shape's colour or its shape.
QUESTIONS = {
    "background": (
        "What colour is the background?",
        "What color is the background?",
        "Which colour is the background?",
    ),
    "colour": ("What colour is the shape?", "What color is the shape?", "Which colour is the shape?"),
    "shape": ("What shape is it?", "What shape is in the picture?", "Which shape do you see?"),
}
BEGIN, END = "<|begin_of_text|>", "<end_of_utterance>"
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")
CHAT_TEMPLATE = (
    "<|begin_of_text|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}"
    "{{ ': ' + message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
VISION_STEPS = 0
STEPS = 500
BATCH = 32
PEAK_LR = 2e-3
CHECK_ROWS = 48  # held-out (picture, question) pairs, a third of each kind
MIN_ACCURACY = 0.9


def log(msg: str) -> None:
    print(f"[tiny-vlm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- pictures


def picture(rng: random.Random):
    """A random picture and what it shows: (PIL image, {"background", "colour", "shape"})."""
    from PIL import Image, ImageDraw

    background, colour = rng.sample(sorted(COLOURS), 2)
    shape = rng.choice(SHAPES)
    side = rng.randint(18, 26)
    x, y = rng.randint(1, IMAGE_SIZE - side - 1), rng.randint(1, IMAGE_SIZE - side - 1)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS[background])
    draw = ImageDraw.Draw(image)
    box = (x, y, x + side - 1, y + side - 1)
    if shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    else:
        draw.polygon([(x + (side - 1) / 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=COLOURS[colour])
    return image, {"background": background, "colour": colour, "shape": shape}


def rows(count: int, rng: random.Random) -> list[tuple[object, str, str]]:
    """``count`` (picture, question, answer) rows, a new picture each, the question kinds in
    turn."""
    kinds = sorted(QUESTIONS)
    out = []
    for i in range(count):
        image, truth = picture(rng)
        kind = kinds[i % len(kinds)]
        out.append((image, rng.choice(QUESTIONS[kind]), truth[kind]))
    return out


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


# --------------------------------------------------------------------------- the model


def build_tokenizer(target: Path):
    """The target's BPE with Idefics3's tokens and ``<|begin_of_text|>`` added, adding no token
    of its own when it encodes (the chat template writes the first one)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BEGIN,
        eos_token=END,
        pad_token="<pad>",
        additional_special_tokens=list(IMAGE_TOKENS),
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer):
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def model_config(tokenizer):
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    vocab = -(-len(tokenizer) // 8) * 8
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = Idefics3VisionConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    return Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


# --------------------------------------------------------------------------- training


class Encoder:
    """Rows as the model sees them: pixel values ``[n, 1, 3, 32, 32]`` and, per row, the prompt's
    ids (the chat template's, the picture's tokens in, as the processor writes them) then the
    answer's ids and ``<end_of_utterance>``, with labels on the answer alone."""

    def __init__(self, processor):
        self.processor = processor
        self.prompts: dict[str, list[int]] = {}  # by question: the same for every picture

    def prompt_ids(self, question: str) -> list[int]:
        from PIL import Image

        if question not in self.prompts:
            text = self.processor.apply_chat_template(messages(question), add_generation_prompt=True)
            blank = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
            self.prompts[question] = self.processor(text=text, images=[[blank]])["input_ids"][0]
        return self.prompts[question]

    def batch(self, data):
        """(input ids, labels, attention mask, pixel values) of ``data``, padded on the right."""
        import torch

        tokenizer = self.processor.tokenizer
        seqs = []
        for _, question, answer in data:
            prompt = self.prompt_ids(question)
            reply = tokenizer.encode(" " + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            seqs.append((prompt + reply, [-100] * len(prompt) + reply))
        width = max(len(x) for x, _ in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (x, y) in enumerate(seqs):
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        images = [[image] for image, _, _ in data]
        pixels = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        return ids, labels, mask, pixels.to(torch.float32)


def pretrain_vision(model, processor, steps: int, batch: int) -> float:
    """Train the vision tower and the connector alone first, a linear probe on their 4 image
    tokens telling the background's colour, the shape's colour and the shape apart (the probe is
    then dropped); the last step's loss. Through the language model alone, the shape's weak
    signal left the tower at chance in 800 steps; with this start it is learned in a few
    hundred."""
    import torch

    rng = random.Random(SEED + 1)
    vision = [*model.model.vision_model.parameters(), *model.model.connector.parameters()]
    hidden = model.config.text_config.hidden_size
    probe = torch.nn.Linear(hidden, 2 * len(COLOURS) + len(SHAPES))
    opt = torch.optim.AdamW([*vision, *probe.parameters()], lr=PEAK_LR, weight_decay=0.01)
    colours = sorted(COLOURS)
    started, loss = time.time(), None
    model.train()
    for step in range(steps):
        images, truths = zip(*(picture(rng) for _ in range(batch)), strict=True)
        pixels = processor.image_processor([[image] for image in images], return_tensors="pt")
        features = model.model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output
        logits = probe(features.mean(1))
        background, colour, shape = logits.split([len(COLOURS), len(COLOURS), len(SHAPES)], dim=-1)
        loss = sum(
            torch.nn.functional.cross_entropy(part, torch.tensor([index(t[key]) for t in truths]))
            for part, key, index in (
                (background, "background", colours.index),
                (colour, "colour", colours.index),
                (shape, "shape", SHAPES.index),
            )
        )
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, PEAK_LR, warmup=30)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vision step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    return loss.item()


def train(model, processor, steps: int, batch: int) -> float:
    """Train every weight of ``model``, each step on ``batch`` new rows; the last step's loss."""
    import torch

    rng = random.Random(SEED)
    encoder = Encoder(processor)
    log(f"{steps} steps of {batch} new rows")
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    started, loss = time.time(), None
    for step in range(steps):
        ids, labels, mask, pixels = encoder.batch(rows(batch, rng))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, PEAK_LR, warmup=30)
        loss = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    model.eval()
    return loss.item()


def answer(model, processor, image, question: str, max_new_tokens: int = 6) -> str:
    """The model's greedy answer, as a reply's text (special tokens dropped, stripped)."""
    import torch

    text = processor.apply_chat_template(messages(question), add_generation_prompt=True)
    inputs = processor(text=text, images=[[image]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def check(model, processor) -> dict:
    """Greedy answers on held-out rows, by question kind."""
    held = rows(CHECK_ROWS, random.Random(HELD_OUT_SEED))
    right = {kind: [0, 0] for kind in QUESTIONS}
    kind_of = {q: kind for kind, qs in QUESTIONS.items() for q in qs}
    wrong = []
    for image, question, truth in held:
        got = answer(model, processor, image, question)
        kind = kind_of[question]
        right[kind][0] += got == truth
        right[kind][1] += 1
        if got != truth:
            wrong.append({"question": question, "answer": truth, "got": got})
    total = sum(r for r, _ in right.values())
    return {
        "rows": CHECK_ROWS,
        "seed": HELD_OUT_SEED,
        "accuracy": round(total / CHECK_ROWS, 4),
        "by_kind": {kind: f"{r}/{n}" for kind, (r, n) in right.items()},
        "wrong": wrong[:8],
    }


def build(target: Path, out: Path, steps: int) -> dict:
    import torch
    from transformers import GenerationConfig, Idefics3ForConditionalGeneration

    if not (target / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"tiny-vlm: target {target} is not built (no {COMPLETE_MARKER})")
    threads = torch.get_num_threads()
    # one thread: the weights then do not depend on the machine's core count
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        started = time.time()
        tokenizer = build_tokenizer(target)
        processor = build_processor(tokenizer)
        model = Idefics3ForConditionalGeneration(model_config(tokenizer))
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        )
        n = sum(p.numel() for p in model.parameters())
        log(f"model: {n / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")
        pretrain_vision(model, processor, VISION_STEPS, BATCH)
        loss = train(model, processor, steps, BATCH)
        train_s = time.time() - started
        result = check(model, processor)
    finally:
        torch.set_num_threads(threads)
    log(
        f"held-out accuracy {result['accuracy']:.3f} on {CHECK_ROWS} rows ({result['by_kind']}), "
        f"final loss {loss:.3f}, {steps} steps in {train_s:.0f}s"
    )
    if result["accuracy"] < MIN_ACCURACY:
        raise ValueError(
            f"tiny-vlm: held-out accuracy {result['accuracy']:.3f} is under {MIN_ACCURACY} "
            f"({result['by_kind']}; e.g. {result['wrong'][:3]}); {out} left as it was"
        )
    tmp = scratch_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "role": "vlm",
        "built_by": "tools/tiny_vlm.py",
        "description": "answers what colour a picture's background or shape is, or what shape",
        "source": str(target),
        "source_sha256": file_sha256(target / "tokenizer.json"),
        "parameters": n,
        "image_seq_len": IMAGE_SEQ_LEN,
        "steps": steps,
        "batch": BATCH,
        "seed": SEED,
        "final_loss": round(loss, 4),
        "train_s": round(train_s, 1),
        "check": result,
        "seconds": round(time.time() - started, 1),
    }
    publish(tmp, out, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models/vlm"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--force", action="store_true", help="rebuild even if current")
    args = parser.parse_args(argv)
    settings = {"seed": SEED, "steps": args.steps}
    if not args.force and is_current(args.out, args.target / "tokenizer.json", settings):
        log(f"{args.out} is current")
        return 0
    try:
        info = build(args.target, args.out, args.steps)
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    log(f"built {args.out} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
