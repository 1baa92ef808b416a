"""`StepBatchSampler` never puts one utterance twice in a batch, and stays a pure function
of (seed, batch number, rank): passes are still permutations, resume is exact."""

from __future__ import annotations

import random

import pytest

from speechattn.tasks.pretrain import StepBatchSampler


def samplers(n: int, batch: int, world: int, batches: int, bucket: int = 5, **kw):
    rng = random.Random(n)
    lengths = [rng.randint(20, 1500) for _ in range(n)]
    return [
        StepBatchSampler(n, batch, batches, seed=7, rank=r, world_size=world, lengths=lengths,
                         bucket_size=bucket, **kw)
        for r in range(world)
    ]  # fmt: skip


@pytest.mark.parametrize("world", [1, 2])
def test_no_utterance_twice_in_a_batch_over_several_passes(world):
    n, batch, batches = 97, 4, 160  # 97 is no multiple of a pool: pools span two passes
    ranks = samplers(n, batch, world, batches)
    first = ranks[0]
    passes = batches * batch * world // n
    assert passes >= 6 and first.bucket_size == 5
    for i in range(batches):
        items = [u for s in ranks for u in s.batch(i)]
        assert len(items) == batch * world and len(set(items)) == len(items), (i, items)
    stream = [first._item(q) for q in range(passes * n)]
    for e in range(passes):  # every pass is still a permutation of the dataset
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    # the case is real: the seeded permutations alone put an utterance twice in some pool
    W = first.pool_items
    naive = [first._permutation(q // n)[q % n] for q in range(passes * n)]
    pools = [naive[k : k + W] for k in range(0, len(naive) - W + 1, W)]
    assert any(len(set(p)) < W for p in pools)


def test_order_is_a_pure_function_of_the_batch_number_after_the_swaps():
    (sequential,) = samplers(97, 4, 1, 200)
    in_order = [sequential.batch(i) for i in range(200)]
    for i in random.Random(0).sample(range(200), 40):  # cold sampler, any batch first
        assert samplers(97, 4, 1, 200)[0].batch(i) == in_order[i]
    (resumed,) = samplers(97, 4, 1, 200, start=123)
    assert [[u for _, u in keys] for keys in resumed] == in_order[123:]


def test_pools_shrink_to_half_a_small_dataset():
    (sampler,) = samplers(23, 3, 1, 60, bucket=50)  # 50 batches of 3 would hold 150 items
    assert sampler.bucket_size == 23 // 6 and sampler.pool_items <= 23 / 2
    for pool in range(60 // sampler.bucket_size):
        ids = range(pool * sampler.bucket_size, (pool + 1) * sampler.bucket_size)
        items = [u for i in ids for u in sampler.batch(i)]
        assert len(set(items)) == len(items)


def test_too_few_utterances_for_the_global_batch_is_an_error():
    with pytest.raises(ValueError, match=r"9 training utterances for global batches of 8 "
                       r"\(batch_size 4 x 2 ranks\).*at least 15"):  # fmt: skip
        StepBatchSampler(9, 4, 10, seed=0, world_size=2)
    StepBatchSampler(15, 4, 10, seed=0, world_size=2)  # 2G - 1 is enough
