"""Shared helpers for the benchmarks: a built-in text corpus, seeded workloads, timing and table printing.

Benchmarks are scripts, not tests: run them as modules from the repository root (``python -m bench.<name>``).
Nothing here touches the engine; workloads are plain token-id lists that any system can consume.
"""

from __future__ import annotations

import contextlib
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# A varied corpus of English prose and source code. Prompts are cut from shuffled concatenations of these
# paragraphs, so they read like real inputs (the tokenizer sees ordinary words, identifiers and whitespace)
# rather than random ids, which would give unrepresentative tokenizer and cache behaviour.
CORPUS: tuple[str, ...] = (
    "The Roman Empire reached its greatest extent under Trajan in 117 AD, stretching from the northern "
    "border of Britain to the deserts of Mesopotamia. Its roads, more than eighty thousand kilometres of "
    "them, carried soldiers, merchants and letters at a pace that would not be matched in Europe for a "
    "thousand years. Yet the same distances that made the empire rich also made it fragile: an emperor "
    "in Rome could take weeks to learn that a frontier province had rebelled, and by then the rebellion "
    "had often chosen its own emperor.",
    "Photosynthesis converts light energy into chemical energy stored in sugar. In the thylakoid "
    "membranes of the chloroplast, chlorophyll absorbs photons and uses their energy to split water, "
    "releasing oxygen as a by-product. The electrons freed in this way travel along a transport chain "
    "that pumps protons across the membrane, and the resulting gradient drives ATP synthase. In the "
    "Calvin cycle, the ATP and NADPH made by the light reactions fix carbon dioxide into three-carbon "
    "sugars that the plant later assembles into glucose.",
    "def merge_sort(items: list[int]) -> list[int]:\n    if len(items) <= 1:\n        return items\n    "
    "middle = len(items) // 2\n    left = merge_sort(items[:middle])\n    right = "
    "merge_sort(items[middle:])\n    merged = []\n    i = j = 0\n    while i < len(left) and j < "
    "len(right):\n        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += "
    "1\n        else:\n            merged.append(right[j])\n            j += 1\n    "
    "merged.extend(left[i:])\n    merged.extend(right[j:])\n    return merged\n",
    "To bake a simple loaf of bread, dissolve a teaspoon of dried yeast in three hundred millilitres of "
    "warm water and leave it for ten minutes until it foams. Mix in five hundred grams of strong white "
    "flour and a teaspoon of salt, then knead the dough on a floured surface for about ten minutes, "
    "until it is smooth and springs back when pressed. Cover it and let it rise in a warm place for an "
    "hour, shape it into a loaf, let it rise again, and bake it at two hundred and twenty degrees for "
    "thirty to thirty-five minutes.",
    "SELECT c.customer_id, c.name, COUNT(o.order_id) AS orders, SUM(o.total) AS revenue\nFROM customers "
    "AS c\nJOIN orders AS o ON o.customer_id = c.customer_id\nWHERE o.created_at >= DATE '2024-01-01'\n  "
    "AND o.status <> 'cancelled'\nGROUP BY c.customer_id, c.name\nHAVING COUNT(o.order_id) > 3\nORDER BY "
    "revenue DESC\nLIMIT 20;\n",
    "The lighthouse keeper had not spoken to another person in forty-one days when the boat appeared on "
    "the horizon. At first he thought it was a trick of the fog, one of the grey shapes that the sea "
    "liked to make in the early morning, but the shape grew larger and acquired a mast, then a sail, "
    "then a small figure waving from the bow. He put down his coffee, buttoned his coat against the wind "
    "and walked down the hundred and twelve steps to the landing, wondering what news could be worth "
    "such a crossing.",
    "async function fetchWithRetry(url, options = {}, retries = 3) {\n  for (let attempt = 0; attempt <= "
    "retries; attempt++) {\n    try {\n      const response = await fetch(url, options);\n      if "
    "(!response.ok) {\n        throw new Error(`HTTP ${response.status}`);\n      }\n      return await "
    "response.json();\n    } catch (err) {\n      if (attempt === retries) throw err;\n      await new "
    "Promise((r) => setTimeout(r, 2 ** attempt * 100));\n    }\n  }\n}\n",
    "A central bank raises interest rates to cool an economy in which prices are rising too quickly. "
    "Higher rates make borrowing more expensive for households and firms, so they spend and invest less; "
    "demand falls, and with it the pressure on prices. The effect is slow and uncertain, arriving over a "
    "year or two, which is why central bankers speak of acting on forecasts rather than on today's "
    "figures, and why they are so often criticised both for moving too late and for moving too far.",
    "## Installation\n\nInstall the package from PyPI with `pip install example-tool`, or from a "
    "checkout with `pip install -e .[dev]`. The tool needs Python 3.10 or newer. After installing, run "
    "`example-tool --help` to see the available commands.\n\n## Configuration\n\nSettings are read from "
    "`example.toml` in the current directory, then from environment variables prefixed with `EXAMPLE_`. "
    "Command-line flags override both.\n",
    "Mount Everest rises 8,849 metres above sea level on the border between Nepal and the Tibet "
    "Autonomous Region. The first confirmed ascent was made by Edmund Hillary and Tenzing Norgay in May "
    "1953, by the southeast ridge. Today hundreds of climbers attempt the summit each spring, when a "
    "short window of calm weather opens between the winter winds and the summer monsoon, and the queues "
    "that form below the Hillary Step have become one of the mountain's most photographed and most "
    "dangerous features.",
    "use std::collections::HashMap;\n\nfn word_counts(text: &str) -> HashMap<String, usize> {\n    let "
    "mut counts = HashMap::new();\n    for word in text.split_whitespace() {\n        let word = "
    "word.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();\n        if !word.is_empty() {\n  "
    "          *counts.entry(word).or_insert(0) += 1;\n        }\n    }\n    counts\n}\n",
    "Dear Ms. Alvarez,\n\nThank you for your letter of 12 March regarding the delayed delivery of your "
    "order. I am sorry for the inconvenience this has caused. Our records show that the parcel was held "
    "at the regional sorting centre because of an incomplete address label. It has now been relabelled "
    "and dispatched, and you should receive it within three working days. As a gesture of goodwill we "
    "have refunded the shipping charge to your original payment method.\n\nYours sincerely,\nDaniel "
    "Okafor\nCustomer Relations\n",
    "The theory of plate tectonics explains why earthquakes and volcanoes cluster along narrow belts. "
    "The Earth's rigid outer shell is broken into about a dozen large plates that move a few centimetres "
    "a year over the hotter, softer mantle beneath. Where plates pull apart, as along the Mid-Atlantic "
    "Ridge, magma rises to form new crust; where they collide, one may sink beneath the other, building "
    "mountain ranges and deep ocean trenches; and where they slide past each other, stress accumulates "
    "until it is released in an earthquake.",
    "#!/usr/bin/env bash\nset -euo pipefail\n\nBACKUP_DIR=\"/var/backups/$(date +%Y-%m-%d)\"\nmkdir -p "
    "\"$BACKUP_DIR\"\nfor db in $(psql -Atc \"SELECT datname FROM pg_database WHERE NOT "
    "datistemplate\"); do\n  echo \"dumping $db\"\n  pg_dump --format=custom \"$db\" > "
    "\"$BACKUP_DIR/$db.dump\"\ndone\nfind /var/backups -maxdepth 1 -type d -mtime +14 -exec rm -rf {} +\n",
    "\"Are you sure this is the right road?\" asked Mira, peering at the map.\n\"Quite sure,\" said her "
    "brother, who was not sure at all. \"The river should be on our left, and there it is.\"\n\"That is "
    "a ditch, Tomas.\"\n\"It is a small river.\"\nThey walked on in silence for a while, until the ditch "
    "ended in a field of sheep and the road ended in a gate, and Tomas admitted, with great dignity, "
    "that the map might be old.",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n        self.capacity = capacity\n "
    "       self.data: OrderedDict[str, bytes] = OrderedDict()\n\n    def get(self, key: str) -> bytes | "
    "None:\n        if key not in self.data:\n            return None\n        "
    "self.data.move_to_end(key)\n        return self.data[key]\n\n    def put(self, key: str, value: "
    "bytes) -> None:\n        self.data[key] = value\n        self.data.move_to_end(key)\n        if "
    "len(self.data) > self.capacity:\n            self.data.popitem(last=False)\n",
    "Sleep is not a passive state. During the night the brain cycles several times through light sleep, "
    "deep slow-wave sleep and rapid-eye-movement sleep, each stage with its own pattern of electrical "
    "activity. Deep sleep appears to help consolidate facts learned during the day, while REM sleep is "
    "associated with vivid dreams and with the processing of emotional memories. Adults who regularly "
    "sleep less than six hours show measurable declines in attention, reaction time and mood, even when "
    "they report feeling fine.",
    "{\n  \"name\": \"inventory-service\",\n  \"version\": \"2.4.1\",\n  \"port\": 8080,\n  "
    "\"database\": {\n    \"host\": \"db.internal\",\n    \"pool_size\": 20,\n    \"timeout_ms\": 5000\n "
    " },\n  \"features\": [\"bulk-import\", \"audit-log\", \"soft-delete\"],\n  \"logging\": {\"level\": "
    "\"info\", \"format\": \"json\"}\n}\n",
    "Kyoto served as Japan's imperial capital for more than a thousand years, from 794 until the move to "
    "Tokyo in 1869. Spared from the heaviest bombing of the Second World War, the city kept much of its "
    "historic fabric: some sixteen hundred Buddhist temples, four hundred Shinto shrines, and whole "
    "districts of wooden townhouses with narrow fronts and deep interiors. Visitors who arrive in early "
    "April find the banks of the Kamo River lined with cherry trees in full blossom, and every bridge "
    "crowded with photographers.",
    "The agreement shall commence on the Effective Date and continue for an initial term of twelve (12) "
    "months. Either party may terminate this agreement upon thirty (30) days' written notice to the "
    "other party. Upon termination, the Supplier shall deliver to the Customer all work in progress, and "
    "the Customer shall pay for all services rendered up to the date of termination. Sections 7 "
    "(Confidentiality), 9 (Limitation of Liability) and 12 (Governing Law) shall survive any termination "
    "or expiry of this agreement.",
    "package main\n\nimport (\n\t\"fmt\"\n\t\"net/http\"\n\t\"time\"\n)\n\nfunc handler(w "
    "http.ResponseWriter, r *http.Request) {\n\tname := r.URL.Query().Get(\"name\")\n\tif name == \"\" "
    "{\n\t\tname = \"world\"\n\t}\n\tfmt.Fprintf(w, \"hello, %s at %s\\n\", name, "
    "time.Now().Format(time.RFC3339))\n}\n\nfunc main() {\n\thttp.HandleFunc(\"/\", handler)\n"
    "\thttp.ListenAndServe(\":8080\", nil)\n}\n",
    "Honeybees communicate the location of food with a waggle dance performed on the vertical face of "
    "the comb. The angle of the straight run relative to vertical tells the other foragers the direction "
    "of the flowers relative to the sun, and the duration of the run encodes the distance. Remarkably, "
    "bees correct for the movement of the sun during the day, so a dance performed in the afternoon "
    "points a different way from one performed in the morning to the same patch of clover.",
    "Meeting notes, Tuesday. Attendees: Priya, Marcus, Jun, Elena. 1) The release is moved to the 24th "
    "because the migration script failed on the staging copy of the production database; Jun will add a "
    "dry-run mode. 2) Support tickets about slow search have doubled; Elena suspects the new ranking "
    "query and will profile it. 3) Marcus proposed dropping the legacy export format; agreed for the "
    "next major version, with a deprecation warning in this one. Action items are tracked in the shared "
    "board.",
    "import numpy as np\n\ndef kmeans(x: np.ndarray, k: int, iters: int = 50, seed: int = 0) -> "
    "np.ndarray:\n    rng = np.random.default_rng(seed)\n    centers = x[rng.choice(len(x), size=k, "
    "replace=False)]\n    for _ in range(iters):\n        dist = ((x[:, None, :] - centers[None, :, :]) "
    "** 2).sum(-1)\n        labels = dist.argmin(axis=1)\n        new = np.stack([x[labels == j].mean(0) "
    "if (labels == j).any() else centers[j] for j in range(k)])\n        if np.allclose(new, centers):\n "
    "           break\n        centers = new\n    return labels\n",
    "The violin family developed in northern Italy in the early sixteenth century, and the instruments "
    "made in Cremona by the Amati, Guarneri and Stradivari families are still regarded as the finest "
    "ever built. Scientists have blamed and credited many things for their sound, from the varnish to "
    "the density of wood grown during a cold period in European history, but blind listening tests have "
    "repeatedly found that players cannot reliably tell a Stradivarius from a good modern violin.",
    "Troubleshooting: if the service fails to start with 'address already in use', another process is "
    "bound to the port. Run `ss -ltnp | grep 8080` to find it, then stop that process or change `port` "
    "in the configuration. If the logs show 'permission denied' while opening the data directory, check "
    "that the service user owns it (`chown -R svc:svc /srv/data`). For any other error, start the "
    "service with `--log-level debug` and include the full log when you open an issue.",
)


@dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: list[int]
    output_len: int


def _prompt_ids(tokenizer: Any, rng: random.Random, length: int) -> list[int]:
    """``length`` tokens from a shuffled run of the corpus, starting at a random token of the first paragraph.

    The random start makes prompts share (almost) no prefix, so a prefix cache cannot turn one request's work
    into another's: the benchmark measures batching, not caching.
    """
    order = list(CORPUS)
    rng.shuffle(order)
    ids: list[int] = []
    start: int | None = None
    while start is None or len(ids) < start + length:
        chunk = tokenizer.encode("\n\n".join(order) + "\n\n", add_special_tokens=False)
        if start is None:
            first = len(tokenizer.encode(order[0], add_special_tokens=False))
            start = rng.randrange(max(1, first))
        ids.extend(chunk)
        rng.shuffle(order)
    return ids[start : start + length]


def make_workload(
    tokenizer: Any,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[Request]:
    """``num_requests`` requests with prompt and output lengths uniform in the inclusive ranges given.

    Deterministic for a given seed and tokenizer.
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_len)
        olen = rng.randint(*output_len)
        requests.append(Request(_prompt_ids(tokenizer, rng, plen), olen))
    return requests


def parse_range(text: str) -> tuple[int, int]:
    """``"50-600"`` -> ``(50, 600)``; for argparse ``type=``."""
    lo, sep, hi = text.partition("-")
    if not sep:
        raise ValueError(f"expected LO-HI, got {text!r}")
    a, b = int(lo), int(hi)
    if not 0 < a <= b:
        raise ValueError(f"expected 0 < LO <= HI, got {text!r}")
    return a, b


@contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` holds the elapsed wall seconds and ``t[1]`` the CPU seconds of
    the whole process (all threads). On a shared machine CPU time is the steadier of the two: it does not
    grow while other processes hold the cores."""
    box = [0.0, 0.0]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield box
    finally:
        box[0], box[1] = time.perf_counter() - start, time.process_time() - cpu


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (readable as plain text too); floats get 2 decimals, numbers align right."""

    def cell(v: Any, width: int) -> str:
        if isinstance(v, float):
            return f"{v:.2f}".rjust(width)
        return str(v).rjust(width) if isinstance(v, int) else str(v).ljust(width)

    widths = [
        max([len(h), *(len(cell(row[i], 0)) for row in rows)]) for i, h in enumerate(headers)
    ]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        lines.append("| " + " | ".join(cell(v, w) for v, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def machine_summary() -> str:
    """One line describing where the benchmark ran (no host names or paths)."""
    return (
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )


_BUSY_LOOP = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(period - busy)
"""


@contextmanager
def busy_neighbour(spec: str) -> Iterator[None]:
    """While open, a process that keeps a core busy ``MS`` of every ``PERIOD`` milliseconds (``spec``
    "MS/PERIOD"; empty: none): a front end, a detokenizer or a client beside the engine's threads."""
    if not spec:
        yield
        return
    busy, period = spec.split("/")
    if not 0 < float(busy) < float(period):
        raise ValueError(f"a busy neighbour MS/PERIOD needs 0 < MS < PERIOD, got {spec!r}")
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, busy, period])
    time.sleep(0.5)  # past the interpreter's start-up, which keeps a core busy for tens of milliseconds
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL if it has not exited within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 600.0, what: str = "the server") -> None:
    """Poll ``url``/health until it answers 200; raise if ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def hf_model(folder: Any, dtype: torch.dtype) -> Any:
    """transformers' model of a resolved model folder, whose weights are safetensors or a ``model.gguf``."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": "model.gguf"} if (Path(folder) / "model.gguf").is_file() else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **gguf).eval()


def safetensors_folder(folder: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """An HF folder with safetensors weights for ``folder``: itself when it has them; for a GGUF-backed folder a copy
    (config and tokenizer files, the GGUF's weights dequantized to ``dtype``) made once beside it, for peers that
    read only safetensors (vLLM)."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from radixserve.runtime.gguf_convert import WEIGHTS_FILE
    from radixserve.runtime.gguf_weights import iter_gguf_weights
    from radixserve.runtime.weights import load_hf_config

    folder = Path(folder)
    if any(folder.glob("*.safetensors")) or not (folder / WEIGHTS_FILE).is_file():
        return folder
    target = folder.with_name(f"{folder.name}-safetensors-{str(dtype).removeprefix('torch.')}")
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name not in (WEIGHTS_FILE, "radixserve_source.json"):
            shutil.copy2(f, tmp / f.name)
    config = load_hf_config(folder)
    weights = {name: t.to(dtype).contiguous()
               for name, t in iter_gguf_weights(folder / WEIGHTS_FILE, config, keep_quantized=False)}  # fmt: skip
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, and HF re-ties it
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
