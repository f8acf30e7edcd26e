"""A zero-time LLM server that speaks both wires an agent gateway may call upstream, for
agent_gateway_bench.py (run by it; usable alone):

- OpenAI `POST /v1/chat/completions` as vLLM 0.11+ answers it: the prompt is rendered with the
  tokenizer's chat template (as a real server does), `logprobs: true` fills
  `choices[0].logprobs.content`, `return_token_ids: true` adds `choices[0].token_ids` and the root
  `prompt_token_ids` (what rllm-model-gateway 0.1.0 reads);
- SGLang's native `POST /generate` (input_ids in; text, output_ids and meta_info with
  output_token_logprobs [[logprob, id, None], ...] and finish_reason out: the shape of
  steering/tools/scenarios/agent_standin.py, which the project's sglang-http engine is tested on);
- `GET /model_info`, `/get_model_info`, `/health`, `/health_generate`, `/v1/models`, `/server_info`;
  `GET /workers` is a 404 (a server, not a gateway) and the lifecycle POSTs answer success.

Every answer is the same fixed completion: REPLY-1 tokens of a fixed sentence + <|im_end|>
(REPLY=16 by default), cut to max_tokens / max_new_tokens. `--split` makes the sampled ids
non-canonical (one word sent as two tokens whose text is the same), as a real model's samples
sometimes are: re-tokenizing the text then does not give the sampled ids back.

    python gw_standin.py --port 19123 --tokenizer MODEL_DIR [--split]

Needs aiohttp and transformers (the rollout-pipeline venv has both). Counts calls per route:
GET /stats.
"""
from __future__ import annotations

import argparse
import time
import uuid

from aiohttp import web
from transformers import AutoTokenizer

SENTENCE = ("Reading the tool output now; the value looks right, so next I will open the second file "
            "and check the remaining entries carefully before answering.")


def build_reply(tok, reply_tokens: int, split: bool) -> tuple[list[int], str, list[str]]:
    """The fixed completion: ids (ending with EOS), its text (without EOS), and each id's text."""
    body = tok.encode(SENTENCE, add_special_tokens=False)[: reply_tokens - 1]
    text = tok.decode(body)
    assert tok.encode(text, add_special_tokens=False) == body, "the fixed sentence does not round-trip"
    if split:
        vocab = tok.get_vocab()
        pieces = tok.convert_ids_to_tokens(body)
        for i, piece in enumerate(pieces):
            if i == 0 or len(piece) < 4:
                continue
            for cut in range(2, len(piece) - 1):
                a, b = piece[:cut], piece[cut:]
                if a in vocab and b in vocab:
                    body = [*body[:i], vocab[a], vocab[b], *body[i + 1:]]
                    body = body[: reply_tokens - 1]
                    break
            else:
                continue
            break
        text = tok.decode(body)
        assert tok.encode(text, add_special_tokens=False) != body, "the split did not make the ids non-canonical"
    ids = [*body, tok.eos_token_id]
    strings = [tok.decode([t]) for t in ids]
    return ids, text, strings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--split", action="store_true", help="non-canonical sampled ids (same text)")
    ap.add_argument("--model-name", default="standin")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tok.eos_token_id
    ids, text, strings = build_reply(tok, args.reply_tokens, args.split)
    logprobs = [-0.1 - 0.001 * k for k in range(len(ids))]
    stats: dict[str, int] = {}

    def count(route: str) -> None:
        stats[route] = stats.get(route, 0) + 1

    def completion(limit: int | None) -> tuple[list[int], str, str]:
        """The ids served under a max-token limit, their text, and the finish reason."""
        if limit is None or limit >= len(ids):
            return ids, text, "stop"
        out = ids[:limit]
        return out, tok.decode(out), "length"

    async def chat(request: web.Request) -> web.Response:
        count("chat")
        body = await request.json()
        if body.get("stream"):
            return web.json_response({"error": {"message": "the stand-in answers non-streaming only"}}, status=400)
        rendered = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(rendered, add_special_tokens=False)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        out, out_text, finish = completion(limit)
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": out_text, "tool_calls": []},
                        "logprobs": None, "finish_reason": finish, "stop_reason": eos if finish == "stop" else None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": strings[k], "logprob": logprobs[k], "bytes": list(strings[k].encode()), "top_logprobs": []}
                for k in range(len(out))]}
        answer: dict = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                        "model": body.get("model") or args.model_name, "choices": [choice],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                                  "total_tokens": len(prompt) + len(out)}}
        if body.get("return_token_ids"):
            choice["token_ids"] = out
            answer["prompt_token_ids"] = prompt
            answer["prompt_logprobs"] = None
            answer["kv_transfer_params"] = None
        return web.json_response(answer)

    def one_generate(prompt: list[int], sp: dict, body: dict, i: int) -> dict:
        out, out_text, finish = completion(sp.get("max_new_tokens"))
        fin = {"type": "stop", "matched": eos} if finish == "stop" else {"type": "length", "length": len(out)}
        meta = {"id": f"{body.get('rid', 'r')}_{i}", "finish_reason": fin, "prompt_tokens": len(prompt),
                "completion_tokens": len(out), "cached_tokens": 0, "weight_version": "0", "e2e_latency": 0.0}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprobs[k], t, None] for k, t in enumerate(out)]
            k = body.get("top_logprobs_num") or 0
            meta["output_top_logprobs"] = [[[logprobs[0], t, None]] * k for t in out] if k else None
            start = body.get("logprob_start_len", -1)
            if start is not None and start >= 0:
                meta["input_token_logprobs"] = [[None if j == start else -1.0, t, None]
                                                for j, t in enumerate(prompt[start:], start)]
        return {"text": out_text, "output_ids": out, "meta_info": meta}

    async def generate(request: web.Request) -> web.Response:
        count("generate")
        body = await request.json()
        prompt = body.get("input_ids")
        if not prompt:
            return web.json_response({"error": {"message": "input_ids cannot be empty."}}, status=400)
        if body.get("stream"):
            return web.json_response({"error": {"message": "the stand-in answers non-streaming only"}}, status=400)
        sp = body.get("sampling_params") or {}
        n = sp.get("n", 1)
        res = [one_generate(prompt, sp, body, i) for i in range(n)]
        return web.json_response(res if n > 1 else res[0])

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": args.tokenizer, "weight_version": "0", "is_generation": True})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def success(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": args.model_name, "object": "model", "created": 0, "owned_by": "standin", "max_model_len": 8192}]})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23"})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/generate", generate)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/flush_cache", "/pause_generation", "/continue_generation", "/abort_request",
                 "/update_weights_from_disk"):
        app.router.add_post(path, success)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/stats", get_stats)
    print(f"standin: {len(ids)} reply tokens {ids} text {text!r} split={args.split}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
