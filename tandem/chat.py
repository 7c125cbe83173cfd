"""`tandem chat`: a conversation in the terminal, streamed token by token from one `Engine`.

`Conversation` keeps the turns and renders the whole conversation with the model's chat template
for every reply (the prefix cache makes the repeated history cheap). `run_chat` is the terminal
around it: a prompt with line editing, piped turns for scripts, or one question.
"""

from __future__ import annotations

import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TextIO

from tandem.engine.chat_template import chat_template_problem, render_chat_ids
from tandem.engine.engine import Engine
from tandem.request import RequestOutput, SamplingParams

Message = dict[str, str]
DIM, RESET = "\x1b[2m", "\x1b[0m"  # a terminal's faint text, and back
COMMANDS = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


class Conversation:
    """One conversation with the model behind `engine`, which it uses alone: a reply
    runs the engine until nothing is left in it."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None):
        problem = chat_template_problem(engine.tokenizer)
        if problem is not None:
            instead = "" if engine.tokenizer is None else "; use `tandem generate` with a prompt"
            raise ValueError(f"{problem}, so it cannot chat{instead}")
        if params.n != 1:
            raise ValueError(f"n must be 1 in a chat (one reply per turn), got {params.n}")
        self.engine = engine
        self.params = params
        self.system = system
        self.messages: list[Message] = []
        self.last_output: RequestOutput | None = None  # the last finished reply's output
        self.reset()

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, text: str) -> list[int]:
        """The conversation so far plus the user's `text`, rendered by the chat template and
        ready for the assistant's turn."""
        conversation = [*self.messages, {"role": "user", "content": text}]
        return render_chat_ids(self.engine.tokenizer, conversation)

    def reply(
        self,
        text: str,
        on_delta: Callable[[str], None] | None = None,
        on_thinking: Callable[[str], None] | None = None,
    ) -> str:
        """The assistant's answer to `text`, each new piece passed to `on_delta` as it comes
        (a reasoning model's thinking, before it, to `on_thinking`).

        The turn joins the conversation only once the reply is complete (its answer, not its
        thinking): if a callback raises (KeyboardInterrupt from Ctrl-C), the request is aborted,
        the engine drained and the conversation left as it was. A prompt that no longer fits
        raises ValueError.
        """
        request_id = f"chat-{uuid.uuid4().hex}"
        self.engine.add_request(self.prompt_ids(text), self.params, request_id)
        final = None
        try:
            for output in self.engine.stream_outputs():
                if output.request_id != request_id:
                    continue
                if output.delta_reasoning and on_thinking is not None:
                    on_thinking(output.delta_reasoning)
                if output.delta_text and on_delta is not None:
                    on_delta(output.delta_text)
                if output.finished:
                    final = output
        except BaseException:
            self.engine.abort(request_id)
            for _ in self.engine.stream_outputs():  # the abort, then what is still in flight
                pass
            raise
        assert final is not None, "the engine went idle without finishing the reply"
        self.last_output = final
        self.messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": final.text},
        ]
        return final.text


@contextmanager
def sigint_as_flag() -> Iterator[threading.Event]:
    """Ctrl-C sets the flag instead of raising wherever Python happens to be, possibly halfway
    through an engine step, which would leave the engine inconsistent; the caller raises
    KeyboardInterrupt at a safe point (the next piece of the reply)."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed  # only the main thread may set handlers (and it is the one Ctrl-C stops)
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_reply(conversation: Conversation, text: str, out: TextIO) -> None:
    """Write the reply to `out` as it comes, then a newline; Ctrl-C stops it (KeyboardInterrupt
    after the abort, with the conversation unchanged). On a terminal a reasoning model's
    thinking comes first, dimmed, and a blank line before the answer; elsewhere (a pipe, a
    script reading the answers) it is left out."""
    terminal = out.isatty()
    thought = False

    with sigint_as_flag() as pressed:

        def write(delta: str) -> None:
            nonlocal thought
            if thought:
                out.write(RESET + "\n\n")
                thought = False
            out.write(delta)
            out.flush()
            if pressed.is_set():
                raise KeyboardInterrupt

        def think(delta: str) -> None:
            nonlocal thought
            out.write(("" if thought else DIM) + delta)
            thought = True
            out.flush()
            if pressed.is_set():
                raise KeyboardInterrupt

        try:
            conversation.reply(text, write, think if terminal else None)
        except KeyboardInterrupt:
            out.write((RESET if thought else "") + "\n")
            raise
        out.write((RESET if thought else "") + "\n")
        out.flush()


def read_line(interactive: bool) -> str | None:
    """The next line the user typed (None at EOF); `>>> ` and line editing when interactive."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    try:
        return input(">>> ")
    except EOFError:
        print()
        return None


def run_chat(
    engine: Engine, params: SamplingParams, system: str | None, question: str | None
) -> int:
    """The `tandem chat` loop: one question, or turns from the terminal or a pipe until EOF."""
    conversation = Conversation(engine, params, system)
    out = sys.stdout
    if question is not None:
        try:
            stream_reply(conversation, question, out)
        except KeyboardInterrupt:
            return 130  # the shell's code for "stopped by Ctrl-C"
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        with suppress(ImportError):  # input() then gets line editing and history
            import readline  # noqa: F401
        print(COMMANDS, file=sys.stderr)
    while True:
        try:
            line = read_line(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt
            print()
            return 0
        if line is None or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            conversation.reset()
            continue
        if text.startswith("/") and " " not in text:  # a mistyped command, not a question
            print(f"unknown command {text}: {COMMANDS}", file=sys.stderr)
            continue
        try:
            stream_reply(conversation, text, out)
        except KeyboardInterrupt:
            continue  # the reply was aborted and not kept: back to the prompt
        except ValueError as exc:  # most often: the conversation outgrew the context
            if not interactive:
                raise
            print(f"tandem chat: error: {exc} (/reset starts over)", file=sys.stderr)
