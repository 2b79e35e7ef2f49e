import random
import threading
from collections import OrderedDict

from appliance.cache.lru import LruTier


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def filled(n: int, *, budget: int = 100, nbytes: int = 10) -> LruTier[str]:
    tier: LruTier[str] = LruTier("test", budget)
    for i in range(n):
        assert tier.put(k(i), f"v{i}", nbytes) == []
    return tier


def test_put_and_get():
    tier = filled(3)
    assert tier.get(k(1)) == "v1" and tier.get(k(9)) is None
    assert k(0) in tier and k(9) not in tier and len(tier) == 3
    assert tier.bytes == 30 and tier.name == "test"


def test_put_evicts_least_recently_used_first_in_order():
    tier = filled(10)
    evicted = tier.put(k(10), "big", 25)
    assert evicted == [(k(0), "v0"), (k(1), "v1"), (k(2), "v2")]
    assert tier.bytes == 95 and len(tier) == 8


def test_get_bumps_recency():
    tier = filled(10)
    assert tier.get(k(0)) == "v0"
    assert tier.put(k(10), "v10", 10) == [(k(1), "v1")]
    assert k(0) in tier


def test_contains_does_not_bump_recency():
    tier = filled(10)
    assert k(0) in tier
    assert tier.put(k(10), "v10", 10) == [(k(0), "v0")]


def test_put_of_an_existing_key_replaces_it_and_bumps_it():
    tier = filled(10)
    assert tier.put(k(0), "new", 20) == [(k(1), "v1")]
    assert tier.get(k(0)) == "new" and tier.bytes == 100 and len(tier) == 9
    assert tier.put(k(11), "v11", 10)[0] == (k(2), "v2")


def test_entry_larger_than_the_budget_is_returned_not_stored():
    tier = filled(3)
    assert tier.put(k(99), "huge", 101) == [(k(99), "huge")]
    assert k(99) not in tier and tier.bytes == 30 and len(tier) == 3
    assert tier.put(k(98), "exact", 100) == [(k(0), "v0"), (k(1), "v1"), (k(2), "v2")]
    assert tier.bytes == 100 and len(tier) == 1


def test_zero_budget_stores_nothing_with_bytes():
    tier: LruTier[str] = LruTier("zero", 0)
    assert tier.put(k(0), "v", 1) == [(k(0), "v")]
    assert len(tier) == 0 and tier.bytes == 0


def test_pop_removes_and_returns():
    tier = filled(3)
    assert tier.pop(k(1)) == "v1" and tier.pop(k(1)) is None
    assert k(1) not in tier and tier.bytes == 20


def test_resize_down_evicts_at_once_in_lru_order():
    tier = filled(10)
    tier.get(k(0))
    assert tier.resize(70) == [(k(1), "v1"), (k(2), "v2"), (k(3), "v3")]
    assert tier.bytes == 70 and tier.budget_bytes == 70
    assert tier.resize(200) == []
    assert tier.put(k(20), "v20", 100) == [] and tier.bytes == 170
    assert [key for key, _ in tier.resize(0)] == [k(4), k(5), k(6), k(7), k(8), k(9), k(0), k(20)]
    assert len(tier) == 0 and tier.bytes == 0


def test_remove_if_removes_matching_values_and_their_bytes():
    tier = filled(10)
    assert tier.remove_if(lambda v: int(v[1:]) % 2 == 0) == 5
    assert tier.bytes == 50 and len(tier) == 5
    assert all(k(i) not in tier for i in range(0, 10, 2))
    assert tier.remove_if(lambda v: False) == 0


def test_stats_count_hits_and_evictions():
    tier = filled(10)
    tier.get(k(0))
    tier.get(k(1))
    tier.get(k(99))  # a miss is not a hit
    tier.put(k(10), "v10", 20)
    tier.put(k(11), "huge", 1000)  # never stored: not an eviction
    assert tier.stats() == {"bytes": 100, "budget_bytes": 100, "blocks": 9, "hits": 2, "evictions": 2}
    tier.resize(50)
    assert tier.stats()["evictions"] == 7 and tier.stats()["blocks"] == 4


def test_random_operations_match_a_reference_lru_and_stay_under_budget():
    rng = random.Random(1234)
    tier: LruTier[int] = LruTier("prop", 1000)
    model: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
    budget = 1000
    for step in range(3000):
        op = rng.random()
        key = k(rng.randrange(40))
        if op < 0.6:
            nbytes = rng.randrange(0, budget + 200)
            got = tier.put(key, step, nbytes)
            if nbytes > budget:
                want = [(key, step)]
            else:
                model.pop(key, None)
                model[key] = (step, nbytes)
                want = evict(model, budget)
            assert got == want
        elif op < 0.85:
            want = model[key][0] if key in model else None
            if key in model:
                model.move_to_end(key)
            assert tier.get(key) == want
        elif op < 0.95:
            want = model.pop(key)[0] if key in model else None
            assert tier.pop(key) == want
        else:
            budget = rng.randrange(0, 2000)
            assert tier.resize(budget) == evict(model, budget)
        assert tier.bytes == sum(n for _, n in model.values()) <= budget
        assert len(tier) == len(model)
    assert tier.stats()["blocks"] == len(model)


def evict(model: OrderedDict, budget: int) -> list[tuple[bytes, int]]:
    out = []
    while sum(n for _, n in model.values()) > budget:
        key, (value, _) = model.popitem(last=False)
        out.append((key, value))
    return out


def test_concurrent_puts_and_gets_keep_the_accounting_consistent():
    tier: LruTier[int] = LruTier("threads", 5000)
    errors: list[BaseException] = []
    evicted_counts = [0] * 8

    def work(t: int) -> None:
        rng = random.Random(t)
        try:
            for i in range(2000):
                key = k(rng.randrange(200))
                if rng.random() < 0.5:
                    evicted_counts[t] += len(tier.put(key, i, rng.randrange(1, 100)))
                else:
                    tier.get(key)
                if i % 500 == 0:
                    tier.remove_if(lambda v: v % 7 == 0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert 0 < tier.bytes <= 5000
    assert tier.stats()["evictions"] == sum(evicted_counts) > 0
    num_left = len(tier)
    assert len(tier.resize(0)) == num_left  # evicting everything brings the count to exactly 0
    assert tier.bytes == 0 and len(tier) == 0
