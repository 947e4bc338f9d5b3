"""Driver: the one loop of a process that runs the engine's steps and hands on what they say.

    driver = Driver(Engine(model))
    for event in driver.run(session.chat("Hi")):   # one conversation's move, run to its end: the chat's, a piped
        ...                                         # run's, a --tp rank's, a benchmark's
    # the server's worker, many moves at once:
    driver.start(turn.run(), hand_on, ended)        # its items to hand_on as they come; ended(error) at its end
    driver.round()                                  # every task moved on, one engine step, its outputs handed on

A task is a generator (a conversation's move: ChatSession.chat, a server's turn) that yields
what it says (events, a server's items) and the requests it waits on (engine/work.py: a reply
to decode, a text to read). A request yielded is submitted to the engine, and every step's
Output for it goes to the task's hand_on as it comes (a reply's text, an eviction, a read's
progress): never back through the task, which is resumed once its request ended, and reads
what ended it from the request where a failure did. A request another task submitted and is
still in the engine (the sinks a first conversation reads, which the next ones copy) is waited
for without its events.

A task whose consumer goes away before its end (the chat's second Ctrl-C, a closed pipe) is
abandoned: its request leaves the engine, Abandoned is raised where it waits, and it finishes
what it must (a reply closed in the cache) in rounds run at once, what it says dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import cast

from streamchat.engine.engine import Engine
from streamchat.engine.work import Request
from streamchat.errors import CacheStateError
from streamchat.generation.events import Compiled, Compiling, Event
from streamchat.generation.requests import DecodingReply

# A conversation's move as the driver runs it: what it says, and the requests it waits on, in order.
Task = Generator[object, None, object]


class Abandoned(BaseException):  # like GeneratorExit: no error, and no `except Exception` takes it
    """Raised in a task where it waits, when whoever consumed it went away: it finishes what it must, unheard."""


@dataclass(eq=False)
class _Running:
    """A task under way: where its items go, who hears of its end, and the request it waits on."""

    task: Task
    hand_on: Callable[[object], None]
    ended: Callable[[BaseException | None], None]
    awaiting: Request | None = None
    abandoned: bool = False  # Abandoned is raised in it at its next move


class Driver:
    """The engine's steps, and the tasks that wait on them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ready: list[_Running] = []  # to move on this round
        # Each request in the engine, by id: the tasks it resumes when it ends, the one that submitted it first.
        self._waiting: dict[int, list[_Running]] = {}

    def start(
        self, task: Task, hand_on: Callable[[object], None], ended: Callable[[BaseException | None], None]
    ) -> None:
        """Run `task` from the next round on: what it says to `hand_on`, and `ended(error)` once it ended (None: it
        returned; else what it raised)."""
        self._ready.append(_Running(task, hand_on, ended))

    def busy(self) -> bool:
        """Whether any task is under way."""
        return bool(self._ready or self._waiting)

    def round(self) -> None:
        """Every task moved on to the request it waits on (its items handed on the way), then one engine step,
        whose outputs go to the tasks awaiting their requests."""
        self.move_tasks()
        compiling = self.announce_compiling()
        self.take_step(compiling)

    def run(self, task: Task) -> Iterator[Event]:
        """Run `task` to its end (and whatever else is under way with it), yielding what it says as it comes;
        raises what it raised. Closed before its end, it abandons the task."""
        said: list[object] = []
        ended: list[BaseException | None] = []
        running = _Running(task, said.append, ended.append)
        self._ready.append(running)
        try:
            while not ended:
                self.move_tasks()
                yield from _taken(said)
                if ended:
                    break
                compiling = self.announce_compiling()
                yield from _taken(said)  # before the step that compiles, which takes a while
                if not self.take_step(compiling) and running.awaiting is not None and not ended:
                    raise CacheStateError("the engine's step ran nothing while a conversation waited on it")
                yield from _taken(said)
        except GeneratorExit:
            if not ended:
                self._abandon(running, ended)
            raise
        except BaseException:
            # Torn off mid-round (a second Ctrl-C, a failure of the driver's own): the task goes with it, and no
            # step may go on with its request (the conversation is rebuilt from its transcript: recover()).
            if not ended:
                self._tear_off(running)
            raise
        if ended[0] is not None:
            raise ended[0]

    # ---- the phases of a round -------------------------------------------------------------

    def move_tasks(self) -> None:
        """Move every ready task on until it waits on a request, or ends."""
        while self._ready:  # one at a time: a round torn off half way leaves the rest ready
            self._move(self._ready.pop(0))

    def announce_compiling(self) -> list[_Running]:
        """The tasks whose reply's next step compiles first, told so (the chat says it: it takes a while)."""
        runner = self.engine.runner
        compiling = [
            running
            for running in self._owners()
            if isinstance(request := running.awaiting, DecodingReply)
            and runner.will_compile(request.cache)
            and not request.stop_requested()
        ]
        for running in compiling:
            running.hand_on(Compiling())
        return compiling

    def take_step(self, compiling: list[_Running] | None = None) -> bool:
        """One engine step: each output's events to the task that submitted its request, and every task waiting on
        a request that ended made ready. Whether the step did anything."""
        outputs = self.engine.step()
        for output in outputs:
            waiting = self._waiting.get(id(output.request), [])
            for event in output.events:
                waiting[0].hand_on(event)
            if output.ended:
                self._waiting.pop(id(output.request), None)
                for running in waiting:
                    running.awaiting = None
                self._ready += waiting
        compiled = self.engine.runner.compiled
        for running in compiling or []:
            if compiled is not None and compiled.seconds is not None:  # None: no step has compiled yet
                running.hand_on(Compiled(compiled.seconds))
        return bool(outputs)

    # ---- helpers ---------------------------------------------------------------------------

    def _move(self, running: _Running) -> None:
        while True:
            try:
                if running.abandoned:
                    running.abandoned = False
                    item = running.task.throw(Abandoned())
                else:
                    item = next(running.task)
            except StopIteration:
                running.ended(None)
                return
            except (Exception, Abandoned) as error:
                running.ended(error)
                return
            if isinstance(item, Request):
                running.awaiting = item
                waiting = self._waiting.setdefault(id(item), [])
                if not waiting:  # a request another task submitted is only waited for
                    self.engine.submit(item)
                waiting.append(running)
                return
            running.hand_on(item)

    def _owners(self) -> list[_Running]:
        """The tasks whose requests are in the engine, each the first to have submitted it."""
        return [waiting[0] for waiting in self._waiting.values()]

    def _abandon(self, running: _Running, ended: list[BaseException | None]) -> None:
        """`running`'s consumer went away: its request leaves the engine (when it submitted it), Abandoned is
        raised where it waits, and rounds run until it ends, what it says dropped. What else ended it is raised."""
        running.hand_on = _dropped
        running.abandoned = True
        request, running.awaiting = running.awaiting, None
        if request is not None:
            self._give_up(running, request)
        while not ended:  # rounds until it ended
            self.move_tasks()
            self.take_step()
        if ended[0] is not None and not isinstance(ended[0], Abandoned):
            raise ended[0]

    def _tear_off(self, running: _Running) -> None:
        """`running` ends where it stands, unfinished: its request leaves the engine, the task is closed."""
        if running.awaiting is not None:
            self._give_up(running, running.awaiting)
            running.awaiting = None
        self._ready = [other for other in self._ready if other is not running]
        running.task.close()

    def _give_up(self, running: _Running, request: Request) -> None:
        """`running` waits on `request` no longer: the request leaves the engine when it submitted it, and it moves
        next."""
        waiting = self._waiting.pop(id(request), [])
        others = [other for other in waiting if other is not running]
        if waiting and waiting[0] is running:  # no step may go on with its request behind its back
            self.engine.leave(request.cache)
            for other in others:
                other.awaiting = None
            # It moves first: what it gives up (the sinks it was reading) is given up before the others look.
            self._ready = [running, *self._ready, *others]
        else:
            self._waiting[id(request)] = others
            self._ready.insert(0, running)


def _taken(said: list[object]) -> Iterator[Event]:
    """What was said so far, and no longer."""
    items = cast("list[Event]", said.copy())  # a conversation's move says only events
    said.clear()
    yield from items


def _dropped(item: object) -> None:
    pass
