"""Generate text with a Hugging Face model larger than memory: ``deepoffload.from_pretrained`` builds the model on
the ``meta`` device (no memory for the weights), loads its blocks from the model's folder straight to storage, one
block at a time, and streams them back in as they run. With ``--tiny`` a small random Llama is written to a folder
first, and the output is checked against ``from_pretrained`` in memory.

    python examples/hf_stream_generate.py --model path/to/model-folder [--folder /nvme] [--prompt "Hello"]
    python examples/hf_stream_generate.py --tiny
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

import deepoffload


def write_tiny_model(folder: str) -> None:
    """A small random Llama saved as Hugging Face saves any model (config.json + safetensors)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a folder written by save_pretrained (config.json + safetensors shards)")
    parser.add_argument("--folder", default=None, help="where the blocks go (your NVMe); default: a temp folder")
    parser.add_argument("--prompt", default=None, help="text to continue (needs the model's tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a few seconds: a small random Llama, checked")
    args = parser.parse_args(argv)
    if not args.tiny and not args.model:
        parser.error("pass --model FOLDER, or --tiny")
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            args.model = f"{scratch}/tiny-llama"
            write_tiny_model(args.model)
        folder = args.folder or scratch
        # --8<-- [start:quickstart]
        # built on "meta" (no memory for the weights), loaded block by block to storage; in eval mode
        model, off = deepoffload.from_pretrained(args.model, path=folder)
        # --8<-- [end:quickstart]
        import transformers

        if args.prompt:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
            ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        else:
            ids = torch.tensor([[1, 5, 9, 2, 7]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        print(tokenizer.decode(out[0]) if args.prompt else f"generated ids: {out[0].tolist()}")
        print(f"streamed: {off.stats}")
        off.close(restore=False)  # nothing was trained: drop the swap files
        if not args.tiny:
            return 0
        reference = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        same = torch.equal(out, expected)
        print(f"identical to from_pretrained in memory: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
