"""``entrenar chat``: talk to a model line by line; each turn renders the whole conversation."""

from __future__ import annotations

import argparse
import difflib
import sys

from entrenar.cli.generate import chat_ids, require_chat_template
from entrenar.cli.options import add_model_args, add_sampling_args, load_model
from entrenar.cli.stream import stream_generate

HELP = ("type a message; Ctrl-C stops a reply (the turn is dropped), /reset clears the conversation, "
        "/exit or /quit (or end of input) quits, /help says this; start a message with // to send one that "
        "begins with /")
COMMANDS = ("/help", "/reset", "/exit", "/quit")


def unknown_command(word: str) -> str:
    """What chat says to a ``/word`` it does not know (instead of sending it to the model)."""
    close = difflib.get_close_matches(word, COMMANDS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown command {word}{hint} (commands: {', '.join(COMMANDS)}; // sends a message that starts with /)"


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "chat", parents=parents, help="chat with a model interactively",
        description=f"Chat with a model through its chat template: {HELP}.",
    )
    add_model_args(parser)
    parser.add_argument("--system", metavar="TEXT", help="system message that opens the conversation")
    add_sampling_args(parser, max_new_tokens=256)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    require_chat_template(tokenizer, args.model)  # fail now, not after the first message
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP, file=sys.stderr)
    messages = list(opening)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # end of input
            break
        text = line.rstrip("\n")
        if text.startswith("//"):
            text = text[1:]  # a message that begins with "/", sent as typed less one slash
        elif text.strip().startswith("/"):
            command = text.split()[0]
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                messages = list(opening)
                if interactive:
                    print("(conversation cleared)", file=sys.stderr)
            else:
                print(HELP if command == "/help" else unknown_command(command), file=sys.stderr)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = stream_generate(model, tokenizer, chat_ids(tokenizer, messages, args.model), args, sys.stdout)
        except KeyboardInterrupt:  # stops this reply, not the chat (Ctrl-C at the prompt still quits)
            messages.pop()
            print()
            print("(reply stopped; that turn is not kept)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0
