"""JSONSchemaBench: coverage, grammar correctness and compile time of the grammar backends, per subset.

For every schema of the JSONL file (one object per line: ``subset``, ``id``, ``schema``, ``valid``, ``invalid``;
see the README beside the data), a backend compiles the schema (within ``--timeout`` seconds, or it counts as
not covered) and walks every instance token by token, serialized as the server serializes JSON (compact
separators, ``ensure_ascii=False``) and tokenized canonically; an instance is accepted when all its tokens are and
the grammar may end there. At every step the mask is compared with ``accept_token``: ``mask_disagree`` counts
tokens one allows and the other does not (llguidance's mask keeps only the canonical token over forced bytes,
so a non-canonical tokenization, which only an invalid instance produces here, can be accepted but unmasked).

  * coverage: schemas compiled within the timeout;
  * valid accepted: for llguidance also "in some key order" (llguidance emits declared properties in schema
    order, so an instance listing them in another order is rejected as written: over-constraint, not a bug);
  * invalid rejected: an accepted invalid instance means a constraint was silently dropped;
  * rewrite exactness (llguidance, when ``jsonschema`` is installed): every instance is validated against the
    original and the rewritten schema, which must agree.

llguidance runs in process through ``GrammarCompiler`` (the serving path, with its timeout); the other backends run
in a worker process that is killed at the timeout. Run from the repository root::

    python -m bench.jsonschemabench ../shared/bench-data/jsonschemabench-300.jsonl --backend llguidance xgrammar
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from radixserve.constrained import (
    ConstraintSpec,
    GrammarCompiler,
    GrammarError,
    Matcher,
    TokenizerInfo,
    allocate_bitmask,
)

BACKENDS = ("llguidance", "xgrammar", "outlines-core")


def load_rows(path: Path, limit: int | None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def tokenizer_info(model: str) -> TokenizerInfo:
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    return TokenizerInfo.from_hf(load_tokenizer(resolve_model(model)))


def serialize(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def walk(matcher: Matcher, info: TokenizerInfo, text: str, bitmask: torch.Tensor) -> tuple[bool, int]:
    """(accepted, mask/accept disagreements) for ``text`` fed token by token."""
    disagreements = 0
    for tok in info.ll_tokenizer.tokenize_str(text):
        matcher.fill_bitmask(bitmask, 0)
        allowed = bool((int(bitmask[0, tok // 32]) >> (tok % 32)) & 1)
        ok = matcher.accept_token(tok)
        disagreements += allowed != ok
        if not ok:
            return False, disagreements
    return matcher.can_terminate() or matcher.is_terminated(), disagreements


def _feed(matcher: Matcher, info: TokenizerInfo, text: str) -> bool:
    start = matcher.num_tokens
    for tok in info.ll_tokenizer.tokenize_str(text):
        if not matcher.accept_token(tok):
            matcher.rollback(matcher.num_tokens - start)
            return False
    return True


def accepts_in_some_order(matcher: Matcher, info: TokenizerInfo, value: Any) -> bool:
    """Search for a key order of ``value`` (at every level) that the grammar accepts; state restored on False.

    At each object step the next key is the first one after which every remaining key can still start, so keys
    come out in the grammar's order when it imposes one (llguidance emits declared properties in schema order).
    """
    start = matcher.num_tokens
    if isinstance(value, dict) and _feed(matcher, info, "{"):
        keys = list(value)
        while keys:
            sep = "," if len(keys) < len(value) else ""
            fallback = None
            for key in keys:
                mark = matcher.num_tokens
                if _feed(matcher, info, sep + serialize(key) + ":") and accepts_in_some_order(
                    matcher, info, value[key]
                ):
                    rest = [k for k in keys if k != key]
                    if all(_probe(matcher, info, "," + serialize(k) + ":") for k in rest):
                        keys = rest
                        break
                    fallback = fallback or key
                matcher.rollback(matcher.num_tokens - mark)
            else:
                if fallback is None:
                    break
                _feed(matcher, info, sep + serialize(fallback) + ":")
                accepts_in_some_order(matcher, info, value[fallback])
                keys.remove(fallback)
        if not keys and _feed(matcher, info, "}"):
            return True
    elif isinstance(value, list) and _feed(matcher, info, "["):
        for i, item in enumerate(value):
            if (i and not _feed(matcher, info, ",")) or not accepts_in_some_order(matcher, info, item):
                break
        else:
            if _feed(matcher, info, "]"):
                return True
    elif not isinstance(value, dict | list) and _feed(matcher, info, serialize(value)):
        return True
    matcher.rollback(matcher.num_tokens - start)
    return False


def _probe(matcher: Matcher, info: TokenizerInfo, text: str) -> bool:
    mark = matcher.num_tokens
    ok = _feed(matcher, info, text)
    matcher.rollback(matcher.num_tokens - mark)
    return ok


def check_instances(grammar: Any, info: TokenizerInfo, row: dict[str, Any], any_order: bool) -> dict[str, int]:
    bitmask = allocate_bitmask(1, info.vocab_size)
    out = Counter(valid=len(row["valid"]), invalid=len(row["invalid"]))
    for kind in ("valid", "invalid"):
        for inst in row[kind]:
            accepted, bad = walk(grammar.new_matcher(), info, serialize(inst), bitmask)
            out["mask_disagreements"] += bad
            out[f"{kind}_accepted"] += accepted
            if kind == "valid" and (accepted or (any_order and _any_order(grammar, info, inst))):
                out["valid_any_order"] += 1
    return dict(out)


def _any_order(grammar: Any, info: TokenizerInfo, inst: Any) -> bool:
    m = grammar.new_matcher()
    return accepts_in_some_order(m, info, inst) and (m.can_terminate() or m.is_terminated())


def rewrite_disagreements(row: dict[str, Any]) -> int:
    """Instances on which ``jsonschema`` judges the original and the rewritten schema differently (-1: no check)."""
    try:
        import jsonschema
    except ImportError:
        return -1
    from radixserve.constrained.backend import llguidance_formats
    from radixserve.constrained.json_schema import as_draft_2020, rewrite_schema

    rewritten = rewrite_schema(row["schema"], llguidance_formats())
    cls = jsonschema.validators.validator_for(row["schema"])
    if cls in (jsonschema.Draft202012Validator, jsonschema.Draft201909Validator):
        rewritten = as_draft_2020(rewritten)  # the rewriter spells tuples the draft-07 way, read by every draft
    original, ours = cls(row["schema"]), cls(rewritten)
    return sum(original.is_valid(i) != ours.is_valid(i) for i in row["valid"] + row["invalid"])


def run_llguidance(rows: list[dict[str, Any]], info: TokenizerInfo, timeout: float) -> list[dict[str, Any]]:
    compiler = GrammarCompiler(info, max_workers=1, cache_size=4, timeout_s=timeout)
    results = []
    try:
        for row in rows:
            start = time.perf_counter()
            res: dict[str, Any] = {"subset": row["subset"], "id": row["id"]}
            try:
                grammar = compiler.compile(ConstraintSpec("json_schema", row["schema"]))
            except GrammarError as exc:
                res.update(status=exc.kind, error=str(exc).splitlines()[0][:200], seconds=time.perf_counter() - start)
            else:
                res.update(status="ok", seconds=time.perf_counter() - start)
                res.update(check_instances(grammar, info, row, any_order=True))
                res["rewrite_disagreements"] = rewrite_disagreements(row)
            results.append(res)
    finally:
        compiler.close()
    return results


def _worker(conn: Any, backend: str, model: str, memory_gib: float | None) -> None:
    """Child process: compile one schema per message, report the compile time, then the instance results."""
    from radixserve.constrained.alt_backends import OutlinesCoreBackend, XGrammarBackend

    if memory_gib:  # address space, so leave room for the libraries' mappings (torch maps several GiB)
        import resource

        limit = int(memory_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    info = tokenizer_info(model)
    impl = XGrammarBackend(info) if backend == "xgrammar" else OutlinesCoreBackend(info)
    conn.send("ready")
    while (row := conn.recv()) is not None:
        start = time.perf_counter()
        try:
            grammar = impl.compile(ConstraintSpec("json_schema", row["schema"]))
        except (GrammarError, MemoryError) as exc:
            conn.send(("error", time.perf_counter() - start, str(exc).splitlines()[0][:200] if str(exc) else "memory"))
            continue
        conn.send(("ok", time.perf_counter() - start, None))
        conn.send(check_instances(grammar, info, row, any_order=False))


def _start(ctx: Any, backend: str, model: str, memory_gib: float | None) -> tuple[Any, Any]:
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, backend, model, memory_gib), daemon=True)
    proc.start()
    child.close()  # only the worker holds that end now, so its death reads as EOF here
    if not conn.poll(300) or conn.recv() != "ready":  # tokenizer and backend are built before the clock starts
        raise RuntimeError(f"the {backend} worker did not start")
    return proc, conn


def run_isolated(
    rows: list[dict[str, Any]], backend: str, model: str, timeout: float, memory_gib: float | None
) -> list[dict[str, Any]]:
    """Each schema in a worker process that is killed when compiling or checking outlasts its limit."""
    ctx = mp.get_context("spawn")
    proc, conn = None, None
    results = []
    for row in rows:
        if proc is None:
            proc, conn = _start(ctx, backend, model, memory_gib)
        res: dict[str, Any] = {"subset": row["subset"], "id": row["id"]}
        conn.send(row)
        try:
            if not conn.poll(timeout):
                raise TimeoutError
            status, seconds, error = conn.recv()
            res.update(status=status, seconds=seconds)
            if status != "ok":
                res["error"] = error
            elif conn.poll(max(60.0, 10 * timeout)):
                res.update(conn.recv())
            else:
                raise TimeoutError
        except TimeoutError:
            res.update(status=res.get("status", "timeout"), seconds=res.get("seconds", timeout))
            res.setdefault("error", f"no result within {timeout:g} s")
            proc.kill()
            proc.join()
            proc = None
        except EOFError:  # the worker died (memory limit, crash)
            proc.join()
            proc = None
            res.update(status="crashed", seconds=timeout, error="worker process died")
        results.append(res)
    if proc is not None:
        conn.send(None)
        proc.join(timeout=5)
    return results


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def summarize(results: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[r["subset"]].append(r)
    table = []
    for name, rs in [*sorted(groups.items()), ("ALL", results)]:
        ok = [r for r in rs if r["status"] == "ok" and r["seconds"] <= timeout]
        ms = [r["seconds"] * 1e3 for r in ok]
        total = Counter()
        for r in ok:
            total.update({k: v for k, v in r.items() if isinstance(v, int) and v > 0})
        table.append(
            {
                "subset": name,
                "schemas": len(rs),
                "compiled": len(ok),
                "timeouts": sum(r["status"] == "timeout" for r in rs),
                "valid": f"{total['valid_accepted']}/{total['valid']}",
                "valid_any_order": f"{total['valid_any_order']}/{total['valid']}",
                "invalid_rejected": f"{total['invalid'] - total['invalid_accepted']}/{total['invalid']}",
                "mask_disagree": total["mask_disagreements"],
                "p50_ms": _pct(ms, 50),
                "p90_ms": _pct(ms, 90),
                "max_ms": max(ms, default=float("nan")),
            }
        )
    return table


def print_table(backend: str, table: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    cols = ["subset", "schemas", "compiled", "timeouts", "valid", "valid_any_order", "invalid_rejected"]
    cols += ["mask_disagree", "p50_ms", "p90_ms", "max_ms"]
    print(f"\n### {backend}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in table:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        cells[2] = f"{row['compiled']} ({100 * row['compiled'] / max(row['schemas'], 1):.1f}%)"
        print("| " + " | ".join(cells) + " |")
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        print(f"\nnot compiled ({len(failed)}):")
        for r in failed:
            print(f"- {r['subset']} `{r['id']}` ({r['status']}): {r.get('error', '')[:150]}")
    checked = [r["rewrite_disagreements"] for r in results if r.get("rewrite_disagreements", -1) >= 0]
    if checked:
        print(
            f"\nrewrite exactness (jsonschema, original vs rewritten): {sum(checked)} disagreements on "
            f"{len(checked)} schemas"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", type=Path, help="JSONSchemaBench JSONL file (see the README beside it)")
    ap.add_argument("--backend", nargs="+", choices=BACKENDS, default=["llguidance"])
    ap.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema, seconds")
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model whose tokenizer is used")
    ap.add_argument("--memory-gib", type=float, default=None, help="address-space limit of isolated workers")
    ap.add_argument("--json", type=Path, default=None, help="also write per-schema results here")
    args = ap.parse_args(argv)
    if not args.data.is_file():
        sys.exit(f"no such file: {args.data}")
    rows = load_rows(args.data, args.limit)
    info = tokenizer_info(args.model)
    report: dict[str, Any] = {}
    for backend in args.backend:
        if backend == "llguidance":
            results = run_llguidance(rows, info, args.timeout)
        else:
            results = run_isolated(rows, backend, args.model, args.timeout, args.memory_gib)
        table = summarize(results, args.timeout)
        print_table(backend, table, results)
        report[backend] = {"summary": table, "schemas": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
