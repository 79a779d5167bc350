"""The token path alone: streamed tokens/s, CPU per token per process, and ITL through the real
tokenizer, prefill, decode and frontend services, several source trees side by side.

A decode instance on a model built to produce tokens fast on a CPU puts the load on the path
from decode's step to the client's stream (decode's stream -> frontend -> detokenization ->
the client), not on the model:

    model       Qwen3 shapes cut down to 1 layer, hidden 64 (2 query heads of 32, 1 KV head),
                float32, random weights, a vocabulary of --model-vocab ids (default 4096:
                with Qwen3's 151,936 rows the output projection alone takes ~50 ms per step of
                64 on this 2-core CPU, and decode could not produce more than ~1k tokens/s)
    tokenizer   byte-level BPE of --model-vocab tokens, control tokens included (a synthetic
                vocabulary: English-like words, CJK and emoji split into byte pieces, so deltas
                hold back incomplete characters as with Qwen's). Runs recorded before 2026-11-26
                used Qwen3's 151,643 regular tokens over the model's first --model-vocab ids;
                the services now refuse a tokenizer with more ids than the model has rows

Each tree (`--tree`, repeatable; e.g. a checkout of main beside this branch) starts its own four
services (`python -m mili serve-*` with the tree as working directory), on free ports, decode
and prefill with one torch thread. Rounds alternate the trees (order flipped every round, so
the machine's other load hits each alike); a round is one `mili bench` run (this tree's client,
token-id prompts, ignore_eos, greedy) per concurrency. Per tree and concurrency: streamed
output tokens/s (median of the rounds), CPU milliseconds per streamed token of each service
process (user + system from /proc over all rounds / tokens), and the client's ITL p50/p99
(median of the rounds).

    git worktree add /tmp/mili-main main     # or: git archive main | tar -x -C /tmp/mili-main
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/token_path.py \\
        --tree /tmp/mili-main --tree . --concurrency 64 --concurrency 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QWEN3_REGULAR_TOKENS = 151_643
_LISTENING = re.compile(r"service listening on (\S+)")
_HTTP = re.compile(r" http on (\S+)")
SERVICES = ("tokenizer", "prefill", "decode", "frontend")


# ---- the model and its tokenizer ----------------------------------------------------------------


def _words(rng: random.Random) -> str:
    """One synthetic word: English-like syllables (often with a leading space), CJK or emoji."""
    kind = rng.random()
    if kind < 0.75:
        onsets = [
            "b",
            "c",
            "d",
            "f",
            "g",
            "h",
            "j",
            "k",
            "l",
            "m",
            "n",
            "p",
            "r",
            "s",
            "t",
            "v",
            "w",
            "st",
            "th",
            "ch",
            "sh",
            "pr",
            "tr",
            "bl",
            "gr",
        ]
        syllables = [rng.choice(onsets) + rng.choice("aeiou") for _ in range(rng.randint(1, 4))]
        word = "".join(syllables) + rng.choice(["", "", "s", "ed", "ing", "n", "r"])
        return (" " if rng.random() < 0.7 else "") + word
    if kind < 0.95:
        return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 3)))
    return chr(rng.randint(0x1F300, 0x1F64F))


def build_tokenizer(num_regular: int = QWEN3_REGULAR_TOKENS, seed: int = 0) -> Any:
    """A byte-level BPE with `num_regular` tokens: the 256 bytes, then every byte-prefix of
    synthetic words (each a merge of the prefix one shorter and its last byte), then the demo's
    control and added tokens, as Qwen lays them out."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mili.demo import tokenizer as demo
    from mili.text.byte_decoder import byte_of_char

    byte_chars = {byte: char for char, byte in byte_of_char().items()}
    vocab = {byte_chars[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    rng = random.Random(seed)
    while len(vocab) < num_regular:
        encoded = "".join(byte_chars[b] for b in _words(rng).encode("utf-8"))
        for end in range(2, len(encoded) + 1):
            piece = encoded[:end]
            if piece not in vocab and len(vocab) < num_regular:
                vocab[piece] = len(vocab)
                merges.append((encoded[: end - 1], encoded[end - 1]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in demo.SPECIAL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in demo.ADDED_TOKENS]
    )
    return tokenizer


def build_model(directory: Path, model_vocab: int) -> Path:
    """The benchmark's checkpoint in `directory` (reused when already there)."""
    if (directory / "config.json").exists():
        return directory
    import torch

    from mili.demo import tokenizer as demo
    from mili.engine.model import checkpoint
    from mili.engine.model.config import Qwen3Config

    # The tokenizer fits the model's rows (services refuse a tokenizer larger than the model).
    tokenizer = build_tokenizer(model_vocab - len(demo.SPECIAL_TOKENS) - len(demo.ADDED_TOKENS))
    config = Qwen3Config(
        vocab_size=model_vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        torch_dtype="float32",
        bos_token_id=0,
        eos_token_id=model_vocab - 1,
    )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory.parent))
    checkpoint.write_random_checkpoint(staging, config, seed=0, dtype=torch.float32)
    demo.write_tokenizer_files(staging, tokenizer, 4096)
    # An id the model can emit stands in for EOS (requests here ignore it): decode checks that
    # its EOS ids are rows of the model.
    (staging / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [model_vocab - 1]}) + "\n"
    )
    staging.rename(directory)
    return directory


# ---- one deployment per tree --------------------------------------------------------------------


class _Service:
    def __init__(
        self, tree: Path, args: list[str], log: Path, command: list[str] | None = None
    ) -> None:
        """`mili ARGS` in `tree`, or `command` (a script and its arguments) when given."""
        self._log = log.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree)}
        env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        if command is None:
            command = ["-m", "mili", *args, "--port", "0", "--log-level", "WARNING"]
        self.proc = subprocess.Popen(
            [sys.executable, *command],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=tree,
            env=env,
        )
        assert self.proc.stdout is not None
        self.http_url: str | None = None  # a frontend's HTTP API, when it serves one
        for line in self.proc.stdout:
            if http := _HTTP.search(line):
                self.http_url = http.group(1)
            match = _LISTENING.search(line)
            if match:
                self.address = match.group(1)
                break
        else:
            raise RuntimeError(f"{args[0]} in {tree} exited {self.proc.wait()}; see {log}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@dataclass
class Deployment:
    tree: Path
    services: dict[str, _Service] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        tree: Path,
        model: Path,
        logs: Path,
        name: str,
        device: str | None = None,
        frontend_args: Sequence[str] = (),
        standin_step_ms: float | None = None,
    ) -> Deployment:
        deployment = cls(tree)
        common = ["--model", str(model)]
        try:
            if standin_step_ms is not None:
                # decode_standin.py in the roles of decode and prefill: tokens at a set rate.
                deployment.services["tokenizer"] = _Service(
                    tree, ["serve-tokenizer", *common], logs / f"{name}-tokenizer.log"
                )
                for kind in ("decode", "prefill"):
                    script = [str(ROOT / "benchmarks" / "decode_standin.py"), "--role", kind]
                    script += ["--model-name", model.resolve().name]
                    script += ["--step-ms", str(standin_step_ms)]
                    deployment.services[kind] = _Service(
                        tree, [], logs / f"{name}-{kind}.log", command=script
                    )
            for kind, extra in (
                ("tokenizer", []),
                (
                    "decode",
                    ["--num-blocks", "16384", "--max-running", "512"]
                    + ([] if device is None else ["--device", device]),
                ),
                ("prefill", ["--num-blocks", "4096"]),
            ):
                argv = [f"serve-{kind}", *common, *extra]
                if kind in deployment.services:
                    continue  # a stand-in
                if kind == "prefill":
                    argv += ["--decode", deployment.services["decode"].address]
                deployment.services[kind] = _Service(tree, argv, logs / f"{name}-{kind}.log")
            frontend = [
                "serve-frontend",
                "--tokenizer",
                deployment.services["tokenizer"].address,
                "--prefill",
                deployment.services["prefill"].address,
                "--decode",
                deployment.services["decode"].address,
                "--max-concurrent-requests",
                "4096",
                *frontend_args,
            ]
            deployment.services["frontend"] = _Service(tree, frontend, logs / f"{name}-fe.log")
        except BaseException:
            deployment.stop()
            raise
        return deployment

    def cpu_s(self) -> dict[str, float]:
        return {kind: service.cpu_s() for kind, service in self.services.items()}

    def stop(self) -> None:
        for kind in ("frontend", "prefill", "decode", "tokenizer"):
            if kind in self.services:
                self.services[kind].stop()


def bench(address: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "mili", "bench", "--address", address]
    command += ["--concurrency", str(concurrency)]
    command += ["--num-requests", str(concurrency * args.requests_per_client)]
    command += ["--prompt-tokens", str(args.prompt_tokens)]
    command += ["--output-tokens", str(args.output_tokens), "--json", str(out)]
    command += ["--processes", str(args.bench_processes)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary: dict[str, Any] = json.loads(out.read_text())
    # The client's own CPU (all its processes: the spawned ones are waited for): near one
    # core a process, its TTFT and ITL include its own queueing.
    client_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    summary["client_cpu_share"] = client_s / summary["wall_s"]
    if summary["num_errors"]:  # counted, and left out of the tokens: said in the table
        print(f"bench errors against {address}: {summary['errors']}", flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="source tree (repeat)")
    parser.add_argument(
        "--frontend-args",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra serve-frontend flags for the tree of the same position (repeat; '' for "
        "none), e.g. --tree . --tree . --frontend-args '' --frontend-args '--stream-interval 4'",
    )
    parser.add_argument("--concurrency", type=int, action="append", help="default: 64 and 256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--model-vocab", type=int, default=4096)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a cache dir")
    parser.add_argument(
        "--decode-device",
        default=None,
        help="decode's --device (cuda: a decode fast enough "
        "to load one frontend with >= 10k tokens/s; default: the service's own, cpu)",
    )
    parser.add_argument(
        "--decode-standin-step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="replace decode and prefill by benchmarks/decode_standin.py, one token per "
        "running request every MS (the frontend's ceiling without a model's limits)",
    )
    parser.add_argument(
        "--bench-processes",
        type=int,
        default=1,
        metavar="P",
        help="`mili bench --processes`: client processes (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    levels = args.concurrency or [64, 256]
    cache = Path.home() / ".cache" / "mili" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = build_model(
        args.model_dir or cache / f"token-path-fit-v{args.model_vocab}", args.model_vocab
    )
    logs = Path(tempfile.mkdtemp(prefix="mili-token-path-"))
    print(f"model {model}; logs {logs}; load average {os.getloadavg()[0]:.2f}", flush=True)
    extra = [shlex.split(a) for a in args.frontend_args]
    extra += [[]] * (len(trees) - len(extra))
    deployments = [
        Deployment.start(
            t, model, logs, f"tree{i}", args.decode_device, extra[i], args.decode_standin_step_ms
        )
        for i, t in enumerate(trees)
    ]
    rates: dict[tuple[int, int], list[float]] = {}
    itl: dict[tuple[int, int], list[tuple[float, float]]] = {}
    ttft: dict[tuple[int, int], list[tuple[float, float]]] = {}
    client: dict[tuple[int, int], list[float]] = {}
    cpu: dict[tuple[int, int], dict[str, float]] = {}
    tokens: dict[tuple[int, int], int] = {}
    failed: dict[tuple[int, int], int] = {}  # requests that failed, over all rounds
    try:
        for i, d in enumerate(deployments):  # warm-up: first calls, the frontend's first polls
            bench(d.services["frontend"].address, 8, args, logs / f"warm{i}.json")
        for r in range(args.rounds):
            order = list(enumerate(deployments))
            for i, d in order if r % 2 == 0 else order[::-1]:
                for c in levels:
                    before = d.cpu_s()
                    out = bench(d.services["frontend"].address, c, args, logs / f"{i}-{c}-{r}.json")
                    after = d.cpu_s()
                    key = (i, c)
                    rates.setdefault(key, []).append(out["output_tokens_per_s"])
                    itl.setdefault(key, []).append((out["itl"]["p50_ms"], out["itl"]["p99_ms"]))
                    client.setdefault(key, []).append(out["client_cpu_share"])
                    ttft.setdefault(key, []).append((out["ttft"]["p50_ms"], out["ttft"]["p99_ms"]))
                    spent = cpu.setdefault(key, dict.fromkeys(SERVICES, 0.0))
                    for kind in SERVICES:
                        spent[kind] += after[kind] - before[kind]
                    # ignore_eos: every request that did not fail streamed exactly output_tokens
                    tokens[key] = tokens.get(key, 0) + out["num_ok"] * args.output_tokens
                    failed[key] = failed.get(key, 0) + out["num_errors"]
                    print(
                        f"round {r} tree{i} c={c}: {out['output_tokens_per_s']:.0f} tok/s, "
                        f"ITL p50 {out['itl']['p50_ms']:.2f} ms",
                        flush=True,
                    )
    finally:
        for d in deployments:
            d.stop()
    rows = []
    print(
        "| tree | concurrency | streamed tok/s | frontend ms/tok | tokenizer ms/tok "
        "| frontend+tokenizer ms/tok | decode ms/tok | prefill ms/tok | ITL p50 ms | ITL p99 ms "
        "| TTFT p50 ms | TTFT p99 ms | client CPU | failed requests |"
    )
    print("| --- " * 14 + "|")
    for (i, c), values in sorted(rates.items()):
        ms = {k: 1e3 * v / tokens[(i, c)] for k, v in cpu[(i, c)].items()}
        row = {
            "tree": str(trees[i]),
            "concurrency": c,
            "tokens_per_s": statistics.median(values),
            "cpu_ms_per_token": ms,
            "itl_p50_ms": statistics.median(p50 for p50, _ in itl[(i, c)]),
            "itl_p99_ms": statistics.median(p99 for _, p99 in itl[(i, c)]),
            "ttft_p50_ms": statistics.median(p50 for p50, _ in ttft[(i, c)]),
            "ttft_p99_ms": statistics.median(p99 for _, p99 in ttft[(i, c)]),
            "client_cpu_share": statistics.median(client[(i, c)]),
            "frontend_args": args.frontend_args[i] if i < len(args.frontend_args) else "",
            "failed_requests": failed[(i, c)],
        }
        rows.append(row)
        print(
            f"| {trees[i]} {row['frontend_args']} | {c} | {row['tokens_per_s']:.0f} "
            f"| {ms['frontend']:.3f} "
            f"| {ms['tokenizer']:.3f} | {ms['frontend'] + ms['tokenizer']:.3f} "
            f"| {ms['decode']:.3f} | {ms['prefill']:.3f} | {row['itl_p50_ms']:.2f} "
            f"| {row['itl_p99_ms']:.2f} | {row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} "
            f"| {row['client_cpu_share']:.0%} | {failed[(i, c)]} |"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "config": vars(args)}, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
