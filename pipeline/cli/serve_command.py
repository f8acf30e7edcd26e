"""`pipeline serve`: the agent endpoint, OpenAI's API over the pool's workers (`pipeline.serve`)."""

from __future__ import annotations

import argparse

from pipeline.core.command import Command


class ServeCommand(Command):
    name = "serve"
    help = "serve agents: OpenAI's Chat Completions over the queue, sessions, token-exact trajectories"
    connects = True
    pool_use = "names"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1",
                            help="address to bind (default 127.0.0.1; any other needs --api-key)")
        parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
        parser.add_argument("--tokenizer", metavar="PATH",
                            help="a model or tokenizer directory (`demo`: the demo model's): its chat template "
                                 "renders the turns (without it, only /v1/completions with token ids is served)")
        parser.add_argument("--tool-call-parser", metavar="NAME",
                            help="how completions become tool_calls, as SGLang parses them: qwen25, qwen, "
                                 "hermes, llama3, mistral, deepseekv3")
        parser.add_argument("--reasoning-parser", metavar="NAME",
                            help="how completions become reasoning_content: qwen3, qwen3-thinking, deepseek-r1")
        parser.add_argument("--run", metavar="NAME", help="the run sessions go to unless POST /sessions names one "
                                                          "(default: a new name)")
        parser.add_argument("--output", metavar="URL", help="where turn shards go (default: $PIPELINE_OUTPUT, "
                                                            "else the state directory's shards/)")
        parser.add_argument("--model-name", metavar="NAME", help="the model name /v1/models lists (default: the "
                                                                 "tokenizer directory's name)")
        parser.add_argument("--api-key", metavar="KEY", help="clients must send Authorization: Bearer KEY "
                                                             "(required to bind beyond loopback)")
        parser.add_argument("--context-length", type=int, metavar="N",
                            help="the model's context in tokens (default: the tokenizer directory's config)")
        parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                            help="max_tokens when a call gives none (default 1024, within the context)")
        parser.add_argument("--turn-timeout", type=float, default=None, metavar="S",
                            help="seconds a call waits for its turn: then 503 (no worker, paused) or 504 "
                                 "(default 600)")
        parser.add_argument("--no-affinity", dest="affinity", action="store_false",
                            help="send each turn to whichever worker is free, not to its session's home worker "
                                 "(where its prefix is cached)")
        parser.add_argument("--load-factor", type=float, default=None, metavar="C",
                            help="a home worker takes a session's turn while its turns in flight stay within C "
                                 "times the mean (default 1.25); else the turn moves to the least-loaded worker")
        parser.add_argument("--history", choices=["verbatim", "template"], default="verbatim",
                            help="how a chat call's history becomes its prompt, unless its session names its own: "
                                 "verbatim (default) extends the ids the model sampled, its reasoning included; "
                                 "template renders each call as the chat template does (e.g. earlier reasoning "
                                 "stripped), a new branch where that is not an extension (docs/agents.md)")
        parser.add_argument("--max-session-calls", type=int, default=None, metavar="N",
                            help="the most calls one session may start (default 4096); past it a call is a 413")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.demo_model import resolve
        from pipeline.serve.server import ServeConfig, Server

        options = {"host": args.host, "port": args.port, "redis_url": args.redis, "pool": args.pool,
                   "run": args.run, "output": args.output, "tokenizer": args.tokenizer and resolve(args.tokenizer),
                   "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
                   "model_name": args.model_name, "api_key": args.api_key, "context_length": args.context_length}
        if args.max_tokens is not None:
            options["default_max_tokens"] = args.max_tokens
        if args.turn_timeout is not None:
            options["turn_timeout_s"] = args.turn_timeout
        if args.load_factor is not None:
            if args.load_factor < 1:
                raise SystemExit(f"pipeline serve: --load-factor {args.load_factor:g} must be at least 1 (1: no "
                                 "worker above the mean; 1.25: the default)")
            options["load_factor"] = args.load_factor
        options["affinity"] = args.affinity
        options["history"] = args.history
        if args.max_session_calls is not None:
            if args.max_session_calls < 1:
                raise SystemExit(f"pipeline serve: --max-session-calls {args.max_session_calls} must be at least 1")
            options["max_session_calls"] = args.max_session_calls
        server = Server(ServeConfig(**options))
        settings = server.turns.settings
        print(f"pipeline serve: pool {settings.pool!r}, run {settings.run!r}, model {settings.model!r} on "
              f"http://{args.host}:{args.port}/v1 (sessions: /sessions/<id>/v1)", flush=True)
        server.run()
        return 0
