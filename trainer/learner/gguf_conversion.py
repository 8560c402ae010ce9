"""`python -m trainer.learner.gguf_conversion`: turns an embedded model's GGUF into a bf16 Hugging Face directory.

`gateway.base_models` starts it when it pulls an embedded base model (the first start of a gateway on it, `kaizen
pull`), under its lock and into its scratch directory, so that torch and transformers never load in the serving
process. It speaks the model-job protocol of `trainer.control.model_jobs`: a `GgufConversionJob` on stdin, its
log on stderr, and exit status `DONE` or `FAILED`.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

from trainer.control.model_jobs import (
    DONE,
    FAILED,
    GgufConversionJob,
    configure_child_logging,
    read_job,
    take_result_channel,
)

log = logging.getLogger("trainer.learner.gguf_conversion")  # not __name__: the process runs it as __main__

_VERIFY_PROMPT = "What is the capital of France?"
_VERIFY_TOKENS = 12


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str) -> None:
    """Dequantise the GGUF into a fresh bf16 model and save it, then check it still generates the same.

    A GGUF-quantised transformers model refuses ``save_pretrained``, so the dense weights are copied
    into a model built from the config alone.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, file_name = str(gguf_path.parent), gguf_path.name
    log.info("loading and dequantising %s", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    loaded = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=file_name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = AutoConfig.from_pretrained(src_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.eval()
    del loaded

    tokenizer.chat_template = chat_template
    tokenizer.model_max_length = config.max_position_embeddings
    log.info("saving bf16 safetensors checkpoint to %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    expected = _greedy_ids(model, tokenizer)
    del model
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    got = _greedy_ids(reloaded, AutoTokenizer.from_pretrained(out_dir))
    if not got or got != expected:
        raise RuntimeError(f"saved model does not reproduce the GGUF model: {got} != {expected}")
    log.info("verified greedy output of saved model: %r", tokenizer.decode(got))


def _greedy_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids of a short greedy reply, used to check the saved checkpoint against the source."""
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": _VERIFY_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=_VERIFY_TOKENS, do_sample=False)
    return [int(t) for t in out[0, inputs["input_ids"].shape[1] :]]


def main() -> int:
    take_result_channel()  # nothing to say on it: only its status and its log
    job = read_job(GgufConversionJob)
    configure_child_logging(job.log_level)
    started = time.monotonic()
    try:
        convert_gguf(Path(job.gguf), Path(job.out_dir), job.chat_template)
    except Exception:
        log.exception("converting %s failed", job.gguf)
        return FAILED
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log.info("converted %s in %.1f s (peak RSS %.0f MiB)", job.gguf, time.monotonic() - started, peak_mib)
    return DONE


if __name__ == "__main__":
    sys.exit(main())
