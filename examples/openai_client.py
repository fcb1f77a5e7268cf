"""Query a ddtree-speculating ``vllm serve`` with the OpenAI client: chat, completion, streamed chat.

    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--model NAME]
                                     [--max-tokens N] [--json OUT]

``--model`` defaults to the first model the server lists. Prints each answer, then the server's
speculative-decoding counters from ``/metrics`` (drafts, draft tokens, accepted tokens, accepted
tokens per tree depth) and the mean acceptance length. The completion also asks for its token ids (vLLM's ``return_token_ids``), the
exact output to compare with another engine. The completion is scored again with the logprobs of
chosen tokens at every position (vLLM's ``logprob_token_ids``). One request asks for more logprobs
than the server allows: the server answers HTTP 400 with the reason, and the completion is sent
again after it, to show the server keeps serving. ``logit_bias`` and ``min_p``, which vLLM's own
speculative methods refuse, apply as without speculation (the completion again with its first token
banned, and a sampled one). A chat in JSON mode (``response_format`` with a JSON schema) shows
structured outputs. ``--json`` also writes the answers, the token ids, the scores, the refusal,
the number of streamed chunks and the counters to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request

from openai import BadRequestError, OpenAI


def spec_decode_counters(base_url: str) -> tuple[dict[str, float], list[float]]:
    """Sum of each ``vllm:spec_decode_*_total`` counter on the server's Prometheus endpoint, and the
    accepted draft tokens per position (per tree depth for ddtree)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if not (name.startswith("vllm:spec_decode") and name.endswith("_total")):
            continue
        value = float(line.rsplit(" ", 1)[1])
        if "_per_pos" in name:
            position = int(line.split('position="', 1)[1].split('"', 1)[0])
            per_position[position] = per_position.get(position, 0.0) + value
        else:
            name = name.removesuffix("_total")
            out[name] = out.get(name, 0.0) + value
    return out, [per_position[p] for p in sorted(per_position)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=os.environ.get("VLLM_BASE_URL", "http://127.0.0.1:8000/v1"))
    ap.add_argument("--model", default=None, help="served model name (default: the first listed)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    model = args.model or client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model, temperature=0, max_tokens=args.max_tokens,
        messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
    )
    print("== chat ==\n" + chat.choices[0].message.content)

    def complete(**extra):  # greedy, with the output's token ids (vLLM's extension of the API)
        return client.completions.create(model=model, temperature=0, max_tokens=args.max_tokens,
                                         prompt="def fibonacci(n):", extra_body={"return_token_ids": True, **extra})

    completion = complete()
    token_ids = completion.choices[0].model_extra["token_ids"]
    print("== completion ==\ndef fibonacci(n):" + completion.choices[0].text + f"\n(token ids {token_ids})")

    # The same completion scored: at every position the logprobs of its own first token and of token 0.
    scored = complete(logprobs=1, logprob_token_ids=[token_ids[0], 0]).choices[0]
    scores = {"token_ids": scored.model_extra["token_ids"], "top_logprobs": scored.logprobs.top_logprobs}
    print(f"== completion scored (logprob_token_ids) ==\n{scores['top_logprobs'][:2]} ...")

    # A request the server cannot honour is refused (HTTP 400) with the reason, not clamped.
    try:
        complete(logprobs=1000)  # above the server's max_logprobs (vLLM's default: 20)
        refused = None
    except BadRequestError as e:  # e.message: "Error code: 400 - <the server's reason>"
        refused = {"status": e.status_code, "message": e.message, "param": e.param}
    print(f"== logprobs=1000 refused ==\n{refused}")
    again = complete().choices[0].model_extra["token_ids"]  # the server goes on serving
    print(f"== completion again ==\n{'same token ids' if again == token_ids else f'token ids {again}'}")

    # logit_bias and min_p (chat front-ends send them): the greedy completion with its first token
    # banned starts otherwise; a sampled completion with min_p 0.1 (tokens less likely than 0.1 x the
    # likeliest are never drawn).
    biased = complete(logit_bias={str(token_ids[0]): -100}).choices[0].model_extra["token_ids"]
    print(f"== completion, first token banned by logit_bias ==\n(token ids {biased})")
    sampled = client.completions.create(model=model, temperature=1.0, seed=1, max_tokens=args.max_tokens,
                                        prompt="def fibonacci(n):", extra_body={"min_p": 0.1})
    print("== sampled completion, min_p 0.1 ==\ndef fibonacci(n):" + sampled.choices[0].text)

    # JSON mode: the server constrains the answer to a schema (structured outputs; each tree row is
    # masked by the grammar after its own path, so the answer is the target's own under the schema).
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 20},
                                               "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
              "required": ["color", "hex"]}
    structured = client.chat.completions.create(
        model=model, temperature=0, max_tokens=args.max_tokens,
        messages=[{"role": "user", "content": "Name a color and its hex code, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}},
    )
    json_answer = structured.choices[0].message.content
    print(f"== JSON mode ==\n{json_answer}")

    print("== streamed chat ==")
    chunks, streamed = 0, ""
    stream = client.chat.completions.create(
        model=model, temperature=0, max_tokens=args.max_tokens, stream=True,
        messages=[{"role": "user", "content": "List three colors of the rainbow."}],
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            streamed += chunk.choices[0].delta.content
            sys.stdout.write(chunk.choices[0].delta.content)
            sys.stdout.flush()
    print(f"\n({chunks} chunks)")

    counters, per_position = spec_decode_counters(args.base_url)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    print("== speculative decoding (server /metrics) ==")
    for name, value in sorted(counters.items()):
        print(f"{name} {value:g}")
    print(f"accepted per position: {' '.join(f'{v:g}' for v in per_position)}")
    mean_len = 1 + accepted / drafts if drafts else None
    print(f"mean acceptance length {mean_len:.2f}" if mean_len else "mean acceptance length n/a (no drafts)")
    if args.json:
        result = {"model": model, "chat": chat.choices[0].message.content, "completion": completion.choices[0].text,
                  "completion_token_ids": token_ids, "scored": scores, "refused": refused, "completion_again_token_ids": again,
                  "biased_token_ids": biased, "min_p_text": sampled.choices[0].text,
                  "json_answer": json_answer, "json_finish_reason": structured.choices[0].finish_reason,
                  "stream": streamed, "stream_chunks": chunks, "metrics": counters,
                  "accepted_per_position": per_position,
                  "mean_acceptance_length": mean_len}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
