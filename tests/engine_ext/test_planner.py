"""The step planner on its own, with plain values: no vLLM, no scheduler.

``Req`` carries exactly the attributes the planner reads of vLLM's Request;
``Queue`` is the per-user view of a waiting queue. The limiter is the real one
on a fake clock.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from engine_ext.limiter import OutputRateLimiter
from engine_ext.planner import RECLAIM_COOLDOWN_STEPS, Slots, StepPlan, StepPlanner

NOW_NS = 10_000_000_000


@dataclass(eq=False)  # hashed by identity, as vLLM's Request
class Req:
    request_id: str
    num_prompt_tokens: int = 8
    max_tokens: int = 100
    num_output_tokens: int = 5
    num_computed_tokens: int = 12  # a decode: everything but the last token computed
    num_output_placeholders: int = 0
    next_decode_eligible_step: int = 0
    is_prefill_chunk: bool = False
    arrival_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


class Queue:
    """user -> number of waiting requests."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts = dict(counts or {})

    def __len__(self) -> int:
        return sum(self.counts.values())

    def users(self):
        return self.counts.keys()

    def num_requests_of(self, user: str) -> int:
        return self.counts.get(user, 0)


def make_planner(rates: dict[str, int | None], default: int | None = None):
    clock = [NOW_NS]
    limiter = OutputRateLimiter(default, rates, clock_ns=lambda: clock[0])
    users: dict[Req, str] = {}
    return StepPlanner(limiter, users), users, clock


def add(users: dict[Req, str], user: str, n: int, **kwargs) -> list[Req]:
    start = len(users)
    reqs = [Req(f"{user}-{start + i}", **kwargs) for i in range(n)]
    for r in reqs:
        users[r] = user
    return reqs


def slots(num_held: int, *, max_active: int = 16, max_running: int = 16) -> Slots:
    return Slots(max_active=max_active, max_running=max_running, num_held=num_held, max_chunk=64)


def drain(planner: StepPlanner, user: str) -> None:
    while planner.limiter.try_take(user):
        pass


def test_planner_imports_nothing_from_vllm() -> None:
    code = "import sys, engine_ext.planner; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def four_kinds_of_running(users: dict[Req, str], user: str) -> list[Req]:
    """A decode, a long prefill mid-way, a decode skipped by upstream's cadence,
    and an async look-ahead whose placeholder already reaches max_tokens."""
    return [
        add(users, user, 1)[0],
        add(users, user, 1, num_output_tokens=0, num_prompt_tokens=500, num_computed_tokens=0)[0],
        add(users, user, 1, next_decode_eligible_step=9)[0],
        add(users, user, 1, max_tokens=5, num_computed_tokens=13, num_output_placeholders=1)[0],
    ]


def test_a_user_short_of_tokens_is_charged_only_for_requests_whose_step_samples() -> None:
    planner, users, clock = make_planner({"a": 10})
    decode, *others = four_kinds_of_running(users, "a")
    drain(planner, "a")
    clock[0] += 100_000_000  # one token
    plan, _ = planner.plan([decode, *others], (Queue(),), slots(4), step=5)
    assert plan.charged == [decode] and plan.covered == []
    assert plan.throttled == plan.parked == plan.victims == []
    assert plan.admission_cap is None


def test_a_final_prefill_chunk_held_by_the_prefill_cadence_takes_no_token() -> None:
    """vLLM 0.33's local prefill cadence passes over every running prefill chunk in a held
    step: the chunk would sample, but not this step, so the user's one token goes to its
    decode instead of being charged and refunded after the decode was refused."""
    planner, users, clock = make_planner({"a": 10})
    chunk = add(users, "a", 1, num_output_tokens=0, num_computed_tokens=4, is_prefill_chunk=True)
    decode = add(users, "a", 1)
    drain(planner, "a")
    clock[0] += 100_000_000  # one token
    held = Slots(max_active=16, max_running=16, num_held=2, max_chunk=64, holds_prefill_chunks=True)
    plan, _ = planner.plan([*chunk, *decode], (Queue(),), held, step=5)
    assert plan.charged == decode and plan.throttled == []
    clock[0] += 100_000_000
    plan, _ = planner.plan([*chunk, *decode], (Queue(),), slots(2), step=6)
    assert plan.charged == chunk and plan.throttled == decode  # not held: the chunk first


def test_a_covered_user_is_charged_for_every_request_and_settle_keeps_what_sampled() -> None:
    planner, users, _ = make_planner({"a": 1000})
    running = four_kinds_of_running(users, "a")
    before = planner.limiter.num_available("a", 1000)
    plan, gate = planner.plan(running, (Queue({"a": 2}),), slots(4), step=5)
    assert plan.covered == running and plan.num_covered == {"a": 4} and plan.charged == []
    assert planner.limiter.num_available("a", 1000) == before - 4
    decode, mid_prefill = running[:2]
    mid_prefill.is_prefill_chunk = True
    planner.settle(plan, gate, {decode.request_id: 1, mid_prefill.request_id: 64}, step=5)
    assert planner.limiter.num_available("a", 1000) == before - 1


def test_a_short_user_rotates_its_tokens_and_is_throttled_otherwise() -> None:
    planner, users, clock = make_planner({"a": 10})
    streams = add(users, "a", 3)
    drain(planner, "a")
    served = []
    for step in range(1, 7):
        clock[0] += 100_000_000  # one token's worth at 10 tok/s
        plan, gate = planner.plan(streams, (Queue(),), slots(3), step)
        assert len(plan.charged) == 1 and len(plan.throttled) == 2
        assert plan.admission_cap == 16  # 16 active + 2 throttled, bounded by 16 slots
        served.append(plan.charged[0].request_id)
        planner.settle(plan, gate, {r.request_id: 1 for r in plan.charged}, step)
    assert served == [r.request_id for r in streams] * 2
    assert planner.wakeup_ns is not None
    assert planner.num_throttled["a"] == 12


def test_ready_requests_beyond_the_active_cap_are_parked_one_slot_per_user_at_a_time() -> None:
    planner, users, _ = make_planner({}, default=1000)
    x, y = add(users, "x", 3), add(users, "y", 3)
    before = planner.limiter.num_available("x", 1000)
    first, gate = planner.plan(x + y, (Queue(),), slots(6, max_active=2), step=1)
    # One slot each, though each has budget for its 3 streams.
    assert first.charged == [x[0], y[0]]
    assert len(first.parked) == 4
    # Parked requests were refunded: x paid for the one that got a slot only.
    assert planner.limiter.num_available("x", 1000) == before - 1
    planner.settle(first, gate, {r.request_id: 1 for r in first.charged}, step=1)
    # Each user's slot goes round its streams.
    second, _ = planner.plan(x + y, (Queue(),), slots(6, max_active=2), step=2)
    assert second.charged == [x[1], y[1]]
    # With 3 slots the one left goes to the user given one least recently.
    third, _ = planner.plan(x + y, (Queue(),), slots(6, max_active=3), step=3)
    assert [users[r] for r in third.charged] == ["x", "x", "y"]


def park_slots_over_steps(
    planner: StepPlanner, running: list[Req], clock: list[int], num_steps: int, first_step: int
) -> list[Counter[str]]:
    """Plan ``num_steps`` steps of 20 ms with 4 active slots; user -> slots, per step."""
    given = []
    for step in range(first_step, first_step + num_steps):
        clock[0] += 20_000_000
        plan, gate = planner.plan(running, (Queue(),), slots(len(running), max_active=4), step)
        given.append(Counter(planner.users[r] for r in plan.charged))
        planner.settle(plan, gate, {r.request_id: 1 for r in plan.charged}, step)
    return given


def test_short_active_slots_are_shared_in_proportion_to_rates_over_time() -> None:
    # x (300 tok/s) has budget for its 4 streams every 20 ms step, y (50) for one:
    # 5 ready requests for 4 slots each step. Per step, y's one slot would always weigh
    # more than x's fourth; over time y gets its share, 50 of every 350.
    planner, users, clock = make_planner({"x": 300, "y": 50})
    running = add(users, "x", 4) + add(users, "y", 4)
    given = park_slots_over_steps(planner, running, clock, 350, first_step=1)
    num_y = sum(g["y"] for g in given)
    assert num_y == 4 * 350 * 50 // 350  # 200 slots of 1,400
    # Never more than 2 steps in a row without one (it is owed 4 x 50/350 = 0.57 a step).
    assert "0, 0, 0" not in ", ".join(str(g["y"]) for g in given)
    # A user arriving now starts level with them: it banks nothing for the steps it
    # was away, so it does not take every slot for a while.
    running += add(users, "z", 4)
    planner.limiter.set_rate("z", 50)
    given = park_slots_over_steps(planner, running, clock, 40, first_step=351)
    assert max(g["z"] for g in given) <= 1
    assert abs(sum(g["z"] for g in given) - sum(g["y"] for g in given)) <= 1


def test_a_waiting_stream_takes_a_running_streams_turn_only_with_a_free_slot() -> None:
    planner, users, clock = make_planner({"a": 10})
    running = add(users, "a", 1)
    drain(planner, "a")
    clock[0] += 100_000_000
    full, _ = planner.plan(running, (Queue({"a": 1}),), slots(16), step=1)
    assert full.charged == running  # no slot for the waiting stream: nothing taken
    drain(planner, "a")
    clock[0] += 100_000_000
    free, _ = planner.plan(running, (Queue({"a": 1}),), slots(1), step=2)
    assert free.charged == [] and free.throttled == running
    assert planner.limiter.num_available("a", 5) == 1  # the token waits for the queue


def full_active_slots(newcomer_rate: int | None, **more: int | None):
    """4 active slots all charged (big: 3 streams at 100 tok/s, small: 1 at 50) beside
    2 throttled streams of a drained user, and one request of "newcomer" waiting."""
    planner, users, _ = make_planner({"big": 100, "small": 50, "t": 1, "newcomer": newcomer_rate})
    running = add(users, "big", 3) + add(users, "small", 1) + add(users, "t", 2)
    for user, num in more.items():
        running += add(users, user, num or 0)
    drain(planner, "t")
    return planner, users, running


def test_a_waiting_user_within_its_rate_takes_the_slot_of_the_user_holding_most_per_rate() -> None:
    planner, users, running = full_active_slots(50)
    big_before = planner.limiter.num_available("big", 100)
    plan, gate = planner.plan(running, (Queue({"newcomer": 1}),), slots(6, max_active=4), 1)
    # big holds 3 slots per 100 tok/s, small 1 per 50: big gives one.
    assert plan.parked == [running[2]]
    assert [users[r] for r in plan.charged] == ["big", "big", "small"]
    assert planner.limiter.num_available("big", 100) == big_before - 2  # refunded
    assert plan.admission_cap == 4 + 2 + 1  # active + throttled + the yielded one
    assert gate.quota == {"newcomer": 1}
    assert not gate.admits("small", Req("small-late"))  # the slot is the newcomer's
    assert gate.admits("newcomer", Req("newcomer-1"))
    assert not gate.admits("newcomer", Req("newcomer-2"))  # one slot, one admission


def test_an_unlimited_user_gets_no_slot_and_one_holding_its_share_swaps_its_own() -> None:
    planner, _, running = full_active_slots(None)
    plan, gate = planner.plan(running, (Queue({"newcomer": 1}),), slots(6, max_active=4), 1)
    assert plan.parked == [] and gate.quota is None  # waits for a free slot, as upstream
    # newcomer runs 2 streams at 100 tok/s: 5 ready requests for 4 slots leave it 2, as
    # many per tok/s as big (small's one slot would weigh as much as a second one of
    # theirs: the tie goes by name). Its waiting stream, never served, takes the slot
    # of its own running one.
    planner, users, running = full_active_slots(100)
    running = add(users, "newcomer", 2) + running[1:]
    plan, gate = planner.plan(running, (Queue({"newcomer": 1}),), slots(7, max_active=4), 1)
    assert [users[r] for r in plan.parked] == ["small", "newcomer"]
    assert gate.quota == {"newcomer": 1}


def yield_by_the_rule(
    num_charged: dict[str, int],
    admissible: dict[str, int],
    milli: dict[str, int],
    num_free: int,
    num_slots: int,
    last_slot: dict[str, int],
) -> tuple[dict[str, int], Counter[str]]:
    """The yield's rule written the obvious way (a scan per admission): (quota, user ->
    requests parked), for limited users only (``milli``)."""
    num_held = {u: n for u, n in num_charged.items() if u in milli}
    num_left = dict(num_held)  # charged requests each donor can still give
    takers = {u: n for u, n in admissible.items() if u in milli}
    last = dict(last_slot)

    def share(user: str) -> float:
        return num_held.get(user, 0) / milli[user]

    quota: Counter[str] = Counter()
    parked: Counter[str] = Counter()
    while num_slots > 0 and takers:
        taker = min(takers, key=lambda u: (share(u), last.get(u, -1), u))
        if not num_free:
            donors = [u for u, n in num_left.items() if n]
            if not donors:
                break
            donor = min(donors, key=lambda u: (-share(u), -last.get(u, -1), u))
            if share(donor) <= share(taker):
                if not num_left.get(taker):
                    break
                donor = taker
            parked[donor] += 1
            num_left[donor] -= 1
            num_held[donor] -= 1
        else:
            num_free -= 1
        num_slots -= 1
        quota[taker] += 1
        num_held[taker] = num_held.get(taker, 0) + 1
        last[taker] = 1
        takers[taker] -= 1
        if not takers[taker]:
            del takers[taker]
    return dict(quota), parked


def test_the_yield_decides_as_its_rule_written_the_obvious_way() -> None:
    """The yield keeps its candidates in heaps; over random states it must pick exactly
    the takers and donors a scan per admission picks."""
    for seed in range(300):
        rng = random.Random(seed)
        names = [f"u{i}" for i in range(rng.randrange(2, 12))]
        rates = {u: rng.choice([None, 10, 20, 50, 100]) for u in names} | {"t": 1}
        planner, users, _ = make_planner(rates)
        drain(planner, "t")
        charged = [r for u in names for r in add(users, u, rng.randrange(4))]
        throttled = add(users, "t", rng.randrange(1, 6))
        queue = Queue(
            {
                u: rng.randrange(1, 4)
                for u in rng.sample(names, rng.randrange(1, min(5, len(names))))
            }
        )
        for u in rng.sample(names, rng.randrange(len(names))):
            planner._last_slot_step[u] = rng.randrange(5)
        max_active = len(charged) + rng.choice([0, 0, 1, 2])
        held = len(charged) + len(throttled)
        step_slots = slots(held, max_active=max_active, max_running=held + rng.randrange(8))
        plan = StepPlan(charged=list(charged), throttled=list(throttled))
        num_free = max(0, planner._num_free_active_slots(plan, step_slots))
        num_slots = planner._num_free_slots(step_slots) + len(throttled)
        admissible = planner._admissible_waiting((queue,), min(len(charged), num_slots) + num_free)
        expected_quota, expected_parked = yield_by_the_rule(
            Counter(users[r] for r in charged),
            admissible,
            {u: m for u in names if (m := planner._enforced_milli_rate(u)) is not None},
            num_free,
            num_slots,
            dict(planner._last_slot_step),
        )
        quota = planner._yield_active_slots(plan, (queue,), step_slots, step=1)
        where = f"seed {seed}"
        if quota is None:
            assert not expected_parked, where
            continue
        assert quota == expected_quota, where
        assert Counter(users[r] for r in plan.parked) == expected_parked, where


def test_reclaim_takes_from_the_most_throttled_user_its_cheapest_request() -> None:
    planner, users, _ = make_planner({"hog": 1, "small": 1})
    hog = [
        r
        for i in range(5)
        for r in add(users, "hog", 1, num_prompt_tokens=96 + i, num_computed_tokens=100 + i)
    ]
    small = add(users, "small", 2)
    for user in ("hog", "small"):
        drain(planner, user)
    plan, gate = planner.plan(hog + small, (Queue({"victim": 2}),), slots(7, max_running=7), 1)
    assert [r.request_id for r in plan.victims] == [hog[0].request_id, hog[1].request_id]
    assert plan.victims[0] not in plan.throttled
    assert gate.refused == {"hog"}  # not admitted again in the same step
    assert planner.reclaim_stats.num_reclaims == 2
    assert planner.reclaim_stats.num_tokens_dropped == 201


def test_no_reclaim_for_the_throttled_users_own_queue_or_a_user_without_budget() -> None:
    planner, users, _ = make_planner({"hog": 1, "other": 1})
    hog = add(users, "hog", 4)
    drain(planner, "hog")
    drain(planner, "other")
    # The hog's own queue: its budget is spent anyway, and it never gets its own slot.
    plan, _ = planner.plan(hog, (Queue({"hog": 3, "other": 3}),), slots(4, max_running=4), 1)
    assert plan.victims == []


def test_a_readmitted_request_is_protected_for_the_cooldown() -> None:
    planner, users, _ = make_planner({"hog": 1})
    (hog,) = add(users, "hog", 1)
    drain(planner, "hog")
    plan, gate = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step=1)
    assert plan.victims == [hog]
    # Later the hog stream is admitted again through the gate and scheduled.
    gate.charged[hog.request_id] = hog
    planner.settle(plan, gate, {hog.request_id: 9}, step=10)
    for step in (11, 10 + RECLAIM_COOLDOWN_STEPS - 1):
        again, _ = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step)
        assert again.victims == [], step
    later, _ = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step=42)
    assert later.victims == [hog]


def test_settle_refunds_exactly_what_did_not_sample() -> None:
    planner, users, _ = make_planner({"a": 1000})
    sampled, unscheduled, chunk = add(users, "a", 3)
    before = planner.limiter.num_available("a", 1000)
    plan, gate = planner.plan([sampled, unscheduled, chunk], (Queue(),), slots(3), step=1)
    assert planner.limiter.num_available("a", 1000) == before - 3
    chunk.is_prefill_chunk = True  # upstream cut its chunk short of the end
    planner.settle(plan, gate, {sampled.request_id: 1, chunk.request_id: 40}, step=1)
    assert planner.limiter.num_available("a", 1000) == before - 1


class ReqQueue:
    """user -> its waiting requests, in order."""

    def __init__(self) -> None:
        self.by_user: dict[str, list[Req]] = {}

    def __len__(self) -> int:
        return sum(map(len, self.by_user.values()))

    def users(self):
        return [u for u, reqs in self.by_user.items() if reqs]

    def num_requests_of(self, user: str) -> int:
        return len(self.by_user.get(user, ()))


def samples(request: Req, step: int, max_chunk: int) -> bool:
    """Whether upstream's step would sample ``request`` (the spec the planner mirrors)."""
    remaining = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
    if remaining <= 0 or step < request.next_decode_eligible_step or remaining > max_chunk:
        return False
    return not (
        request.num_output_placeholders > 0
        and request.num_computed_tokens + 2 - request.num_output_placeholders
        >= request.num_prompt_tokens + request.max_tokens
    )


def random_request(rng: random.Random, request_id: str) -> Req:
    kind = rng.choice(["decode"] * 6 + ["prefill", "cadence", "done"])
    if kind == "prefill":
        return Req(request_id, num_prompt_tokens=500, num_output_tokens=0, num_computed_tokens=0)
    if kind == "cadence":
        return Req(request_id, next_decode_eligible_step=rng.randrange(40))
    if kind == "done":
        return Req(request_id, max_tokens=5, num_computed_tokens=13, num_output_placeholders=1)
    return Req(request_id, num_computed_tokens=rng.choice([12, 11]), arrival_time=rng.random())


def test_covering_users_plans_exactly_what_classifying_every_request_plans() -> None:
    """The covered fast path against a planner that classifies every request,
    over random multi-step runs with throttled, covered and unlimited users,
    waiting queues, reclaim, turn stealing and the admission gate."""
    for seed in range(150):
        run_fast_and_exact_side_by_side(seed)


def run_fast_and_exact_side_by_side(seed: int) -> None:
    rng = random.Random(seed)
    rates = {f"u{i}": rng.choice([None, 1, 5, 20, 50, 1000]) for i in range(5)}
    clock = [NOW_NS]
    users: dict[Req, str] = {}
    fast = StepPlanner(OutputRateLimiter(None, rates, clock_ns=lambda: clock[0]), users)
    exact = StepPlanner(OutputRateLimiter(None, rates, clock_ns=lambda: clock[0]), users)
    exact._charge_covered = lambda plan, running, waiting: running  # type: ignore[method-assign]
    fast.count_granted = exact.count_granted = True
    max_running = rng.choice([4, 8])
    max_active = max_running if seed % 5 else max_running - 2
    ids = itertools.count()

    def new_request(user: str) -> Req:
        request = random_request(rng, f"{user}-{next(ids)}")
        users[request] = user
        return request

    running = [new_request(rng.choice(list(rates))) for _ in range(rng.randrange(max_running))]
    queues = (ReqQueue(), ReqQueue())
    for step in range(1, 30):
        clock[0] += rng.randrange(0, 150_000_000)
        for _ in range(rng.randrange(3)):
            user = rng.choice(list(rates))
            rng.choice(queues).by_user.setdefault(user, []).append(new_request(user))
        slots = Slots(max_active, max_running, len(running), max_chunk=64)
        plan_f, gate_f = fast.plan(running, queues, slots, step)
        plan_e, gate_e = exact.plan(running, queues, slots, step)
        where = f"seed {seed} step {step}"
        for name in ("throttled", "parked", "victims"):
            assert [r.request_id for r in getattr(plan_f, name)] == [
                r.request_id for r in getattr(plan_e, name)
            ], f"{name}, {where}"
        assert plan_f.admission_cap == plan_e.admission_cap, where
        charged_f = plan_f.covered + plan_f.charged
        sampling_f = {r.request_id for r in charged_f if samples(r, step, 64)}
        assert sampling_f == {r.request_id for r in plan_e.charged}, where
        # Upstream: the running requests not skipped, then admission through the gate.
        skipped_ids = {r.request_id for r in plan_e.throttled + plan_e.parked + plan_e.victims}
        scheduled = {}
        for request in running:
            if request.request_id in skipped_ids:
                continue
            request.is_prefill_chunk = request.num_prompt_tokens > 64
            if samples(request, step, 64) or request.is_prefill_chunk:
                scheduled[request.request_id] = 64 if request.is_prefill_chunk else 1
        num_free = max_running - (len(running) - len(plan_e.victims))
        admitted: list[Req] = []
        for queue in queues:
            for user in queue.users():
                for request in list(queue.by_user[user]):
                    admits = gate_f.admits(user, request)
                    assert admits == gate_e.admits(user, request), where
                    if not admits:
                        break
                    if len(admitted) < num_free and rng.random() < 0.8:
                        queue.by_user[user].remove(request)
                        admitted.append(request)
                        scheduled[request.request_id] = 12
        fast.settle(plan_f, gate_f, scheduled, step)
        exact.settle(plan_e, gate_e, scheduled, step)
        for user in rates:
            assert fast.limiter.num_available(user, 10**6) == exact.limiter.num_available(
                user, 10**6
            ), f"{user}, {where}"
        assert fast.wakeup_ns == exact.wakeup_ns, where
        assert fast.take_usage() == exact.take_usage(), where
        assert fast.reclaim_stats == exact.reclaim_stats, where
        # The adapter's part: skipped requests wait a step and go to the tail;
        # victims go back to their user's queue; some requests finish.
        for request in plan_e.throttled + plan_e.parked:
            request.next_decode_eligible_step = max(request.next_decode_eligible_step, step + 1)
        for request in plan_e.victims:
            queues[1].by_user.setdefault(users[request], []).insert(0, request)
        kept = [r for r in running if r.request_id not in skipped_ids]
        running = [r for r in kept if rng.random() > 0.1] + plan_e.throttled + plan_e.parked
        running += admitted
        for request in admitted:
            request.is_prefill_chunk = False
