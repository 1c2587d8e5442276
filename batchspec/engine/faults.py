"""A test-only fault, for the tests of supervision (batchspec/engine/supervise.py): with
:data:`DIE_ON_PROMPT_ENV` naming a marker, vLLM's EngineCore process exits at once (``os._exit``,
no clean-up: as a kernel fault or the OOM killer ends it) when it is handed a request whose prompt
holds the marker. batchspec's vLLM plugin installs it in every engine process
(batchspec/engine/cpu_plugin.py); it acts only in an EngineCore of its own process, never in an
engine that runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

from __future__ import annotations

import os

#: The marker: a request whose prompt (its token ids decoded) holds it kills its engine.
DIE_ON_PROMPT_ENV = "BATCHSPEC_TEST_DIE_ON_PROMPT"
#: The exit code of an EngineCore the fault ended.
EXIT_CODE = 70


def install() -> bool:
    """Make EngineCore processes die on the marker's prompts, where the variable names one."""
    marker = os.environ.get(DIE_ON_PROMPT_ENV)
    if not marker:
        return False
    from vllm.v1.engine.core import EngineCoreProc  # the EngineCore of a process of its own

    if getattr(EngineCoreProc, "_batchspec_fault", None) == marker:
        return True
    add_request = EngineCoreProc.add_request
    decoders: dict[str, object] = {}

    def text_of(core, token_ids) -> str:
        path = core.vllm_config.model_config.tokenizer
        if path not in decoders:
            from transformers import AutoTokenizer

            decoders[path] = AutoTokenizer.from_pretrained(path)
        return decoders[path].decode(list(token_ids or ()))

    def dying_add_request(self, request, request_wave: int = 0):
        if marker in text_of(self, request.prompt_token_ids):
            os._exit(EXIT_CODE)
        return add_request(self, request, request_wave)

    EngineCoreProc.add_request = dying_add_request
    EngineCoreProc._batchspec_fault = marker
    return True
