"""A model directory whose forward pass costs almost nothing, for measuring what is around the model.

:func:`build` copies the test model's config (SmolLM2-135M-Instruct, a ``LlamaForCausalLM``: the directory of
``compat/build-model.sh``) with :data:`TINY` applied — 1 layer, hidden size 64, one attention head of
dimension 64 (vLLM's CPU attention backend refuses head dimensions below 32) — next to the test model's real
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, the chat template, ``generation_config.json``,
…). It has no weights: serve it with ``vllm serve DIR --load-format dummy`` (random weights, so the generated
text is arbitrary tokens of the real vocabulary). Nothing is downloaded.

The result is cached under ``$VLLM_NNRP_CACHE/models/tiny-<hash>/`` (default cache
``~/.cache/vllm-nnrp-plugin``), keyed by the source config, the tokenizer files and :data:`TINY`, and is
complete once its ``.complete`` marker exists (the convention of ``compat/build-model.sh``).

    python -m bench.tiny_model SOURCE_MODEL_DIR      # prints the tiny model directory
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys

import orjson

#: the config keys changed from the source model (sizes in elements; one KV head: no grouped-query attention)
TINY = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
#: files of the source model that are not copied (weights; the tiny model has none)
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("VLLM_NNRP_CACHE", pathlib.Path.home() / ".cache" / "vllm-nnrp-plugin"))


def _copied(source: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        p
        for p in source.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.name != "config.json"
        and not p.name.endswith(SKIPPED_SUFFIXES)
    )


def build(source: str | os.PathLike[str]) -> pathlib.Path:
    """The tiny model directory made from ``source`` (built on first use, then reused). Raises
    ``FileNotFoundError`` when ``source`` has no ``config.json`` or no ``tokenizer.json``."""
    source = pathlib.Path(source)
    config = orjson.loads((source / "config.json").read_bytes())
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{source} has no tokenizer.json")
    files = _copied(source)
    key = hashlib.sha256(orjson.dumps(TINY) + (source / "config.json").read_bytes())
    for path in files:
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    out = cache_root() / "models" / f"tiny-{key.hexdigest()[:12]}"
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in files:
        shutil.copy2(path, out / path.name)
    config.update(TINY)
    config["_model_name_or_path"] = f"tiny ({', '.join(f'{k}={v}' for k, v in TINY.items())}) of {source.name}"
    (out / "config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2) + b"\n")
    (out / ".complete").touch()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.tiny_model SOURCE_MODEL_DIR")
    print(build(sys.argv[1]))
