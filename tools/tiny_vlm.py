"""Build a tiny vision-language model, for jobs whose rows carry images and for their tests: an
``Idefics3ForConditionalGeneration`` (a vision-language architecture vLLM's CPU build runs here
without torchvision) that has learned something only the image decides, so that a test can tell
an image that reached the model from one dropped, swapped or sent to the wrong row.

The task: synthetic 32x32 RGB pictures, a solid background of one of six colours with one shape
(square, circle or triangle) of another colour on it, its size (18-26 pixels) and place random;
the questions ask the background's colour, the shape's colour or the shape, in three phrasings
each (the text decides what is asked, the image what the answer is), answered with one word and
``<end_of_utterance>``. Every weight is trained here, from scratch, on pictures drawn as it
trains (a new batch each step): the vision tower (2 layers, hidden 128, 8x8 patches: 16 a
picture), the connector (Idefics3's pixel shuffle, scale factor 4: the 16 patches make one image
token) and a small Llama (2 layers, hidden 128, 2 heads of head_dim 64: vLLM's CPU attention
takes no smaller head). In two stages, as vision-language models are usually trained:

1. the vision tower and the connector alone, with a linear probe on the image token that names
   the background's colour, the shape's colour and the shape (the probe is then dropped);
2. the language model, the vision side frozen, on the questions and answers.

Trained end to end instead, the colours were learned and the shape never (chance after 800
steps): the shape's signal through an untrained language model was too weak to shape the tower,
and unfrozen in stage 2 the tower lost what stage 1 taught it. One image token rather than 4
(scale factor 2) for the same reason: the language model learned to tell the shape from one
token far sooner than to combine it from four (94% against 79% after 400-500 steps).

The build checks HF greedy answers on :data:`CHECK_ROWS` held-out rows (another seed: other
places, sizes and colour pairs), a third of each question kind: at least :data:`MIN_ACCURACY`
right, or it fails and leaves the old directory as it was. Right answers across colours and
shapes mean that the answer follows the picture: another picture, another answer.

The tokenizer is the tiny target's (``--target``: its byte-level BPE; none of its weights) with
Idefics3's tokens added (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<end_of_utterance>``: the end of a turn, so the end of generation) and ``<|begin_of_text|>``,
which the chat template writes: the tokenizer adds no token of its own, so a prompt encodes the
same with or without special tokens. The chat template is Idefics3's form,
``<|begin_of_text|>User:<image>What shape is it?<end_of_utterance>\\nAssistant:`` (a message's
content a string, or a list of ``image`` and ``text`` parts), saved where transformers' processor
and vLLM read it. The processor does not split pictures (``do_image_splitting`` off, longest
edge 32), so a picture is 4 prompt tokens: ``<fake_token_around_image><global-img><image>
<fake_token_around_image>``.

On disk: the model's weights and config, the tokenizer, the processor's files, the chat
template, ``batchspec-model.json`` (what was built from what, the check) and the
``.batchspec-complete`` stamp (built beside the directory and renamed into place); a build that
is current (same target tokenizer, same settings) is skipped. Deterministic (seeded, one thread).
About a minute on one thread (55 s here: stage 1 21 s, stage 2 34 s). Usage: ``python
tools/tiny_vlm.py [--target .models/target] [--out .models/vlm]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_files import COMPLETE_MARKER, file_sha256, is_current, publish, scratch_dir  # noqa: E402

from batchspec.distill.recipe import init_draft_from_target, lr_at  # noqa: E402

SEED = 2718
HELD_OUT_SEED = 31415
IMAGE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 4
#: <image> tokens per picture: (32 / 8) ** 2 patches, pixel-shuffled by 4 x 4 into one
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
VISION_STEPS = 1000
STEPS = 500
BATCH = 32
#: Peak learning rates (warm-up, then cosine: lr_at). The language model's at 2e-3 or 4e-3 stuck
#: answering the shape's colour when asked the background's; at 1e-3 it learned both.
VISION_LR = 2e-3
PEAK_LR = 1e-3
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
        draw.polygon(
            [(x + (side - 1) / 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=COLOURS[colour]
        )
    return image, {"background": background, "colour": colour, "shape": shape}


@dataclass(frozen=True)
class Row:
    image: object  # a PIL image
    truth: dict[str, str]  # what it shows: {"background", "colour", "shape"}
    kind: str  # what the question asks: a key of truth and of QUESTIONS
    question: str

    @property
    def answer(self) -> str:
        return self.truth[self.kind]


def rows(count: int, rng: random.Random) -> list[Row]:
    """``count`` rows, a new picture each, the question kinds in turn."""
    kinds = sorted(QUESTIONS)
    out = []
    for i in range(count):
        image, truth = picture(rng)
        kind = kinds[i % len(kinds)]
        out.append(Row(image, truth, kind, rng.choice(QUESTIONS[kind])))
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
        additional_special_tokens=[*IMAGE_TOKENS, END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer):
    """Idefics3's processor, one image token a picture, pictures not split (longest edge 32)."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    # the processor makes its own three the tokenizer's extra special tokens: <global-img> back
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, END]})
    return processor


def model_config(tokenizer):
    """The Idefics3 config: the vision tower and the Llama text model above, vocabulary padded to
    a multiple of 8."""
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

    def batch(self, data: list[Row]):
        """(input ids, labels, attention mask, pixel values) of ``data``, padded on the right."""
        import torch

        tokenizer = self.processor.tokenizer
        seqs = []
        for row in data:
            prompt = self.prompt_ids(row.question)
            reply = tokenizer.encode(" " + row.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
            seqs.append((prompt + reply, [-100] * len(prompt) + reply))
        width = max(len(x) for x, _ in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (x, y) in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            mask[i, : len(x)] = 1
        images = [[row.image] for row in data]
        pixels = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        return ids, labels, mask, pixels.to(torch.float32)


def pretrain_vision(model, processor, steps: int, batch: int) -> float:
    """Stage 1: the vision tower and the connector, with a linear probe on the image token (the
    connector's output) that names the background's colour, the shape's colour and the shape
    (the sum of the three losses; the probe is dropped after); the last step's loss."""
    import torch

    rng = random.Random(SEED + 1)
    vision = [*model.model.vision_model.parameters(), *model.model.connector.parameters()]
    hidden = model.config.text_config.hidden_size
    probe = torch.nn.Linear(IMAGE_SEQ_LEN * hidden, 2 * len(COLOURS) + len(SHAPES))
    opt = torch.optim.AdamW([*vision, *probe.parameters()], lr=VISION_LR, weight_decay=0.01)
    colours = sorted(COLOURS)
    started, loss = time.time(), None
    model.train()
    for step in range(steps):
        images, truths = zip(*(picture(rng) for _ in range(batch)), strict=True)
        pixels = processor.image_processor([[image] for image in images], return_tensors="pt")
        features = model.model.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output
        logits = probe(features.flatten(1))
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
            group["lr"] = lr_at(step, steps, VISION_LR, warmup=30)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vision step {step}/{steps} loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    return loss.item()


def train(model, processor, steps: int, batch: int) -> float:
    """Stage 2: the language model (embeddings, layers, head), the vision tower and connector
    frozen, each step on ``batch`` new rows; the last step's loss."""
    import torch

    rng = random.Random(SEED)
    encoder = Encoder(processor)
    for p in [*model.model.vision_model.parameters(), *model.model.connector.parameters()]:
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    log(f"language model: {steps} steps of {batch} new rows")
    opt = torch.optim.AdamW(params, lr=PEAK_LR, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    started, loss = time.time(), None
    for step in range(steps):
        ids, labels, mask, pixels = encoder.batch(rows(batch, rng))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, PEAK_LR, warmup=30)
        loss = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
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
    return processor.tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    ).strip()


def check(model, processor) -> dict:
    """Greedy answers on held-out rows, by question kind; and the same questions asked of the
    next row's picture, where its answer differs: the answers that changed with it."""
    held = rows(CHECK_ROWS, random.Random(HELD_OUT_SEED))
    right = {kind: [0, 0] for kind in sorted(QUESTIONS)}
    wrong = []
    for row in held:
        got = answer(model, processor, row.image, row.question)
        right[row.kind][0] += got == row.answer
        right[row.kind][1] += 1
        if got != row.answer:
            wrong.append({"question": row.question, "answer": row.answer, "got": got})
    swapped = followed = 0
    for row, other in zip(held, held[1:] + held[:1], strict=True):
        if other.truth[row.kind] != row.answer:
            swapped += 1
            followed += answer(model, processor, other.image, row.question) == other.truth[row.kind]
    total = sum(r for r, _ in right.values())
    return {
        "rows": CHECK_ROWS,
        "seed": HELD_OUT_SEED,
        "accuracy": round(total / CHECK_ROWS, 4),
        "by_kind": {kind: f"{r}/{n}" for kind, (r, n) in right.items()},
        "swapped_pictures": f"{followed}/{swapped} answers changed to the new picture's",
        "swapped_accuracy": round(followed / max(1, swapped), 4),
        "wrong": wrong[:8],
    }


def settings_of(steps: int, vision_steps: int) -> dict:
    return {
        "seed": SEED,
        "vision_steps": vision_steps,
        "steps": steps,
        "batch": BATCH,
        "vision_lr": VISION_LR,
        "peak_lr": PEAK_LR,
        "image_seq_len": IMAGE_SEQ_LEN,
    }


def build(target: Path, out: Path, steps: int, vision_steps: int, draft_out: Path) -> dict:
    """Build the model into ``out`` (through a scratch directory beside it); its info dict."""
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
        # <end_of_utterance> ends generation, in transformers and in vLLM
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        )
        n = sum(p.numel() for p in model.parameters())
        log(f"model: {n / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, {IMAGE_SEQ_LEN} image token(s)")
        probe_loss = pretrain_vision(model, processor, vision_steps, BATCH)
        loss = train(model, processor, steps, BATCH)
        train_s = time.time() - started
        result = check(model, processor)
    finally:
        torch.set_num_threads(threads)
    log(
        f"held-out accuracy {result['accuracy']:.3f} on {CHECK_ROWS} rows ({result['by_kind']}), "
        f"{result['swapped_pictures']}; loss {loss:.3f} after {vision_steps} + {steps} steps "
        f"in {train_s:.0f}s"
    )
    if result["accuracy"] < MIN_ACCURACY or result["swapped_accuracy"] < MIN_ACCURACY:
        raise ValueError(
            f"tiny-vlm: held-out accuracy {result['accuracy']:.3f} ({result['by_kind']}; "
            f"{result['swapped_pictures']}), wanted at least {MIN_ACCURACY}; e.g. wrong: "
            f"{result['wrong'][:3]}; {out} left as it was"
        )
    tmp = scratch_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    # the processor's files (its chat template too) and the tokenizer's, with the template
    processor.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "role": "vlm",
        "built_by": "tools/tiny_vlm.py",
        "description": "answers the colour of a picture's background or shape, or the shape",
        "source": str(target),
        "source_sha256": file_sha256(target / "tokenizer.json"),
        "parameters": n,
        **settings_of(steps, vision_steps),
        "colours": sorted(COLOURS),
        "shapes": list(SHAPES),
        "questions": QUESTIONS,
        "probe_loss": round(probe_loss, 4),
        "final_loss": round(loss, 4),
        "train_s": round(train_s, 1),
        "check": result,
        "seconds": round(time.time() - started, 1),
    }
    publish(tmp, out, info)
    write_draft(model, tokenizer, draft_out, out)
    return info


def write_draft(model, tokenizer, out: Path, source: Path) -> None:
    """The VLM's draft: a 1-layer Llama started as its language model's first layer, embeddings,
    norm and head (``init_draft_from_target``, as the tiny draft starts), not trained further.
    A draft model of a vision-language target sees the prompt's tokens, not its images (vLLM
    gives it text-only inputs): what a test needs to run a draft model on an image job, where
    speculation must leave greedy text as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = model.config.text_config.to_dict()
    config = LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    config.num_hidden_layers = 1
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = False
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    draft = LlamaForCausalLM(config)
    init_draft_from_target(draft, _LanguageModel(model))
    tmp = scratch_dir(out)
    draft.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {
        "role": "draft",
        "built_by": "tools/tiny_vlm.py",
        "description": "the first layer of the vision-language model's language model, for draft-model tests",
        "source": str(source),
        "parameters": sum(p.numel() for p in draft.parameters()),
    }
    publish(tmp, out, info)
    log(f"draft: {info['parameters'] / 1e6:.2f}M parameters, in {out}")


class _LanguageModel:
    """An Idefics3 model's language model as ``init_draft_from_target`` reads a causal LM."""

    def __init__(self, model):
        self.model = model.model.text_model
        self.lm_head = model.lm_head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=Path(".models/target"))
    parser.add_argument("--out", type=Path, default=Path(".models/vlm"))
    parser.add_argument("--draft-out", type=Path, default=Path(".models/vlm-draft"))
    parser.add_argument("--steps", type=int, default=STEPS, help="language model steps")
    parser.add_argument("--vision-steps", type=int, default=VISION_STEPS)
    parser.add_argument("--force", action="store_true", help="rebuild even if current")
    args = parser.parse_args(argv)
    settings = settings_of(args.steps, args.vision_steps)
    current = (args.draft_out / COMPLETE_MARKER).exists()
    if current and not args.force and is_current(args.out, args.target / "tokenizer.json", settings):
        (args.out / COMPLETE_MARKER).touch()  # checked current: make need not ask again
        log(f"{args.out} is current")
        return 0
    try:
        info = build(args.target, args.out, args.steps, args.vision_steps, args.draft_out)
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    log(f"built {args.out} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
