"""`mili generate "text"`: stream one generation from a running frontend to stdout.

The text goes to stdout as it arrives (a chat's thinking to stderr, so stdout stays the
answer); the finish reason and token usage go to stderr at the end, on a line of their own,
so `mili generate "..." > out.txt` captures only the text and `mili generate "..." 2>&1 | less`
shows the text, then `[finish: ...]` below it. An error is one stderr line with its status
code, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from mili.client import DEFAULT_ADDRESS, timeout_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help="frontend address (default: %(default)s)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the server's")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    parser.add_argument("--system", default=None, help="system message (implies --chat)")
    parser.add_argument(
        "--no-thinking", action="store_true", help="chat: ask Qwen3 to answer without thinking"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="deadline of the call"
    )
    from mili.flags import add_tls_arguments

    add_tls_arguments(parser, is_server=False)


def build_request(args: argparse.Namespace) -> object:
    from mili.pb.common.v1 import chat_pb2, sampling_pb2
    from mili.pb.frontend.v1 import generation_pb2

    sampling = sampling_pb2.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for flag, field in (
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
    ):
        value = getattr(args, flag)
        if value is not None:
            setattr(sampling, field, value)
    request = generation_pb2.GenerateRequest(sampling=sampling)
    if args.chat or args.system is not None or args.no_thinking:
        if args.system is not None:
            request.messages.append(chat_pb2.ChatMessage(role="system", content=args.system))
        request.messages.append(chat_pb2.ChatMessage(role="user", content=args.prompt))
        if args.no_thinking:
            request.enable_thinking = False
    else:
        request.prompt = args.prompt
    return request


def run(args: argparse.Namespace) -> int:
    import grpc

    from mili.pb.common.v1 import sampling_pb2
    from mili.pb.frontend.v1 import generation_pb2_grpc

    # The fields' ranges (the proto's int32/uint64): past them the request could not even be
    # built (a ValueError traceback); a timeout grpc can hold (inf overflowed its deadline).
    for flag, value, top in (
        ("--seed", args.seed, 2**64),
        ("--max-tokens", args.max_tokens, 2**31),
        ("--top-k", args.top_k, 2**31),
    ):
        if value is not None and not 0 <= value < top:
            print(
                f"mili generate: error: {flag} must be in [0, {top}), got {value}", file=sys.stderr
            )
            return 2
    problem = None if args.timeout is None else timeout_problem(args.timeout)
    if problem is not None:
        print(f"mili generate: error: {problem}", file=sys.stderr)
        return 2
    from mili.flags import client_tls
    from mili.rpc.client import connection_hint
    from mili.rpc.status import code_and_details

    try:
        tls = client_tls(args)
    except ValueError as e:
        print(f"mili generate: error: {e}", file=sys.stderr)
        return 2
    request = build_request(args)
    last = None
    wrote_text = wrote_reasoning = ""
    is_answered = False  # a response came: a later UNAVAILABLE is no refused connection
    channel = (
        grpc.insecure_channel(args.address)
        if tls is None
        else grpc.secure_channel(args.address, tls.channel_credentials())
    )
    with channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout):
                is_answered = True
                if response.reasoning_text:
                    sys.stderr.write(response.reasoning_text)
                    sys.stderr.flush()
                    wrote_reasoning = response.reasoning_text
                if response.text:
                    if wrote_reasoning:  # the answer starts on a line of its own
                        _end_reasoning(wrote_reasoning)
                        wrote_reasoning = ""
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                    wrote_text = response.text
                if response.finish_reason:
                    last = response
        except grpc.RpcError as err:
            code, details = code_and_details(err)
            hint = "" if is_answered else connection_hint(err, is_tls=tls is not None)
            _end_reasoning(wrote_reasoning)
            _end_text(wrote_text)
            print(f"mili generate: {code.name}: {details}{hint}", file=sys.stderr)
            return 1
    _end_reasoning(wrote_reasoning)  # all thinking (cut at max_tokens): said, not lost
    _end_text(wrote_text)
    if last is not None:
        reason = sampling_pb2.FinishReason.Name(last.finish_reason)
        reason = reason.removeprefix("FINISH_REASON_").lower()
        print(
            f"[finish: {reason}; prompt tokens {last.usage.prompt_tokens}, "
            f"completion tokens {last.usage.completion_tokens}; request {last.request_id}]",
            file=sys.stderr,
        )
    return 0


def _end_reasoning(last_reasoning: str) -> None:
    if last_reasoning and not last_reasoning.endswith("\n"):
        sys.stderr.write("\n")
        sys.stderr.flush()


def _end_text(last_text: str) -> None:
    """Start a new line before our stderr lines where the text left one open.

    On a terminal the newline goes to stdout (as a shell prompt would need); where stdout and
    stderr are one file or pipe (`2>&1`), it goes to stderr, so stdout stays exactly the
    generated text while the finish line still gets a line of its own.
    """
    if not last_text or last_text.endswith("\n"):
        return
    if sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()
    elif _same_file(sys.stdout, sys.stderr):
        sys.stderr.write("\n")


def _same_file(a: TextIO, b: TextIO) -> bool:
    try:
        return os.path.sameopenfile(a.fileno(), b.fileno())
    except (OSError, ValueError):  # not a real file (a test's StringIO), or closed
        return False
