"""Perplexity of a GGUF on a fixed text, ours against llama.cpp's ``llama-perplexity`` on the same file.

Computed as llama-perplexity computes it: the text's tokens cut into chunks of ``--ctx`` tokens (the first one
replaced by BOS where the vocabulary adds one), and in each chunk the predictions of the second half's tokens
scored, each from the tokens before it in the chunk. Printed: radixserve with the blocks kept, radixserve on their
float32 dequantization, llama-perplexity on the file (and on its F32 conversion), and the ratios.

    python -m bench.perplexity                            # the built-in SmolLM2 (Q4_1), tests/data/perplexity.txt
    python -m bench.perplexity --model PATH.gguf --text FILE
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench import llamacpp_peer as llama
from bench.common import format_table
from bench.peers import PEERS, llama_server
from radixserve.runtime.engine import Engine
from radixserve.runtime.gguf_file import GGUFFile
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.weights import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity.txt"


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    out = [tokens[i : i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]
    return [[bos, *c[1:]] if bos is not None else c for c in out]


def nll_of_chunks(engine: Engine, pieces: list[list[int]]) -> list[float]:
    """Per-token negative log-likelihoods, llama-perplexity's way: tokens ctx/2+1 .. ctx-1 of each chunk."""
    first = len(pieces[0]) // 2
    params = SamplingParams(max_new_tokens=1, temperature=0.0, return_logprob=True, logprob_start_len=first)
    out: list[float] = []
    for result in engine.generate(input_ids=pieces, sampling_params=params):
        scored = [lp.logprob for lp in result["meta_info"]["input_token_logprobs"]]
        want = len(pieces[0]) - 1 - first  # predictions of tokens first+1 .. ctx-1
        assert len(scored) >= want, (len(scored), want)
        out += [-x for x in scored[-want:]]
    return out


def ours(model: str, mode: str, pieces: list[list[int]]) -> float:
    engine = Engine(model=model, device="cpu", dtype="float32", quantization=mode, max_total_tokens=16384)
    try:
        nll = nll_of_chunks(engine, pieces)
    finally:
        engine.shutdown()
    return math.exp(sum(nll) / len(nll))


def theirs(gguf: Path, text: Path, ctx: int, n_chunks: int) -> float:
    binary = subprocess.run(["bash", str(PEERS / "llama-server.sh")], capture_output=True, text=True, check=True)
    tool = Path(binary.stdout.strip().splitlines()[-1]).with_name("llama-perplexity")
    argv = [str(tool), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks", str(n_chunks),
            "-t", "2"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{(run.stdout + run.stderr)[-2000:]}")
    return float(found.group(1))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--skip-llama", action="store_true")
    args = p.parse_args(argv)
    folder = resolve_model(args.model)
    gguf = folder / "model.gguf" if (folder / "model.gguf").is_file() else Path(args.model)
    with GGUFFile(gguf) as f:
        adds_bos = bool(f.metadata.get("tokenizer.ggml.add_bos_token", False))
        bos = f.metadata.get("tokenizer.ggml.bos_token_id") if adds_bos else None
    tokens = load_tokenizer(folder).encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)
    if bos is not None:
        tokens = [int(bos), *tokens]  # llama-perplexity tokenizes with the BOS its vocabulary adds
    pieces = chunks(tokens, args.ctx, int(bos) if bos is not None else None)
    tokenizations = {"our tokens": pieces}
    if not args.skip_llama:
        # llama.cpp tokenizes with its own pre-tokenizer: score its tokens too, so that the comparison with
        # llama-perplexity is on the same ids (its tokenizer is not ours to measure).
        with llama_server(gguf, "", parallel=1) as url:
            text = args.text.read_text(encoding="utf-8")
            theirs_ids = httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]
        if bos is not None:
            theirs_ids = [int(bos), *theirs_ids]
        print(f"llama.cpp's tokens: {len(theirs_ids)}; ours: {len(tokens)}; first difference at "
              f"{next((i for i, (a, b) in enumerate(zip(tokens, theirs_ids)) if a != b), None)}")  # fmt: skip
        tokenizations["llama.cpp's tokens"] = chunks(theirs_ids, args.ctx, int(bos) if bos is not None else None)
    rows = []
    for label, ids in tokenizations.items():
        rows.append([f"radixserve, blocks, {label}", ours(args.model, "auto", ids)])
        rows.append([f"radixserve, float32 of the blocks, {label}", ours(args.model, "none", ids)])
    if not args.skip_llama:
        rows.append(["llama-perplexity, the file", theirs(gguf, args.text, args.ctx, len(pieces))])
        f32 = llama.plain_gguf(args.model)
        if f32 is not None:
            rows.append(["llama-perplexity, its F32", theirs(f32, args.text, args.ctx, len(pieces))])
    print(f"# perplexity, {args.text.name}: {len(tokens)} tokens, {len(pieces)} chunks of {args.ctx}, {args.model}")
    print(format_table(["run", "PPL"], rows))
    if not args.skip_llama:
        print(f"ours (blocks, llama.cpp's tokens) / llama-perplexity (the file): {rows[2][1] / rows[4][1]:.4f}")
        if len(rows) > 5:
            print(f"ours (float32, llama.cpp's tokens) / llama-perplexity (its F32): {rows[3][1] / rows[5][1]:.4f}")


if __name__ == "__main__":
    main()
