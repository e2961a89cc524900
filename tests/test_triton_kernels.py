"""gradsync.triton_kernels: kernels against their torch references, references against independent
formulas and brute force.

The kernels run on CPU under Triton's interpreter, which must be switched on before the kernels are
imported: this file, run as a script, executes the cases in a subprocess with TRITON_INTERPRET=1
and saves what they returned; the tests compare that with the references computed here.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import gradsync.triton_kernels as tk
from gradsync.errors import ConfigError
from gradsync.triton_kernels import reference

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _randn(generator, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=generator).to(dtype)


def _distinct_magnitudes(generator, numel, dtype):
    """±(0.5, 1.0, ..., numel/2) in random order: exact in float16 up to numel = 2048."""
    magnitudes = (torch.randperm(numel, generator=generator) + 1).float() / 2
    signs = torch.randint(0, 2, (numel,), generator=generator) * 2 - 1
    return (magnitudes * signs).to(dtype)


def _seed_sampling_index(numel, index):
    """A seed whose first sampled index (one draw from `numel`) is `index`."""
    return next(seed for seed in range(1000)
                if torch.randint(numel, (1,), generator=torch.Generator().manual_seed(seed)).item() == index)


def _error_feedback_cases(generator):
    cases = {}
    for dtype in (torch.float32, torch.float16):
        name = str(dtype).removeprefix("torch.")
        # one partial tile; 2 × 2 partial tiles; the tl.dot path (r = 20 padded to 32)
        for n, m, r in ((17, 23, 3), (40, 150, 3), (33, 130, 20)):
            M, E, P, Q = (_randn(generator, *shape, dtype=dtype) for shape in ((n, m), (n, m), (n, r), (m, r)))
            cases[f"ef_{name}_{n}x{m}_r{r}"] = ("error_feedback_update", (M, E, P, Q), {})
        M, E, P, Q = (_randn(generator, *shape, dtype=dtype) for shape in ((40, 150), (40, 150), (40, 1), (150, 1)))
        cases[f"ef_{name}_out_r1"] = ("error_feedback_update", (M, E, P, Q), {"out": torch.zeros_like(M)})
    return cases


def _sign_cases(generator):
    numel = 9001  # 3 programs of 4096 elements; not a multiple of 8
    packed = torch.randint(0, 256, (math.ceil(numel / 8),), generator=generator, dtype=torch.uint8)
    with_zeros = [_randn(generator, numel, dtype=dtype) for dtype in (torch.float32, torch.float16)]
    for x in with_zeros:
        x[::7], x[3::7] = 0.0, -0.0  # both zeros pack as 1 (x >= 0)
    cases = {
        "sign_pack_float32": ("sign_pack", (with_zeros[0][:8991].reshape(81, 111),), {}),
        "sign_pack_float16": ("sign_pack", (with_zeros[1],), {}),
        "sign_unpack_float32": ("sign_unpack", (packed, torch.tensor(0.75), numel), {}),
        "sign_unpack_float16": ("sign_unpack", (packed, 1.5, numel, torch.float16), {}),
    }
    for world in (4, 5):  # 4 ranks can tie
        votes = torch.randint(0, 256, (world, math.ceil(numel / 8)), generator=generator, dtype=torch.uint8)
        cases[f"sign_majority_{world}_ranks"] = ("sign_majority_unpack", (votes, numel), {})
    return cases


def _topk_cases(generator):
    cases = {}
    for dtype in (torch.float32, torch.float16):
        name = str(dtype).removeprefix("torch.")
        x = _distinct_magnitudes(generator, 2000, dtype).reshape(40, 50)
        cases[f"count_above_{name}"] = ("count_above", (x, 500.0), {})
        cases[f"topk_threshold_{name}"] = ("topk_threshold", (x, 50, 1000, 3), {})
        cases[f"topk_by_threshold_{name}"] = ("topk_by_threshold", (x, 50, 1000, 3), {})
    spike = torch.tensor([100.0, 1.0, 2.0, 3.0])
    # the single sample lands on the spike: fewer than k candidates, so the exact top k is taken
    cases["topk_by_threshold_miss"] = ("topk_by_threshold", (spike, 3, 1, _seed_sampling_index(4, 0)), {})
    return cases


def _cases():
    generator = torch.Generator().manual_seed(2024)
    return {**_error_feedback_cases(generator), **_sign_cases(generator), **_topk_cases(generator)}


CASES = _cases()


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {key: _copy(v) for key, v in value.items()}
    return value


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {key: _to(v, device) for key, v in value.items()}
    return value


def _assert_matches(actual, expected):
    """Tensors: equal dtype and shape, float values within the dtype's tolerance, others exact."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        _assert_matches(tuple(actual.values()), tuple(expected.values()))
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_matches(a, e)
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        tolerance = TOLERANCE.get(expected.dtype, dict(rtol=0, atol=0))
        torch.testing.assert_close(actual.cpu(), expected.cpu(), **tolerance)
    else:
        assert actual == expected


def _reference_call(name, device="cpu"):
    """(result, arguments after the call) of the reference on a fresh copy of case `name`."""
    function, args, kwargs = _to(_copy(CASES[name]), device)
    return getattr(reference, function)(*args, **kwargs), (args, kwargs)


def run_cases_interpreted(cases_path: str, results_path: str) -> None:
    """Subprocess side: run every case through the kernels, saving (result, arguments after)."""
    from gradsync.triton_kernels import kernels

    results = {}
    for name, (function, args, kwargs) in torch.load(cases_path).items():
        results[name] = (getattr(kernels, function)(*args, **kwargs), (args, kwargs))
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if not tk.triton_available():
        pytest.fail("triton is not importable; it is a declared dependency of gradsync.triton_kernels "
                    "(pip install triton==3.9.0)")
    folder = tmp_path_factory.mktemp("interpreter")
    cases_path, results_path = folder / "cases.pt", folder / "results.pt"
    torch.save(CASES, cases_path)
    done = subprocess.run([sys.executable, __file__, str(cases_path), str(results_path)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"the kernels failed under TRITON_INTERPRET=1:\n{done.stderr[-4000:]}")
    return torch.load(results_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference_under_interpreter(name, interpreted):
    _assert_matches(interpreted[name], _reference_call(name))


def test_error_feedback_update_matches_the_formula_in_float64_and_writes_into_E():
    generator = torch.Generator().manual_seed(0)
    M, E, P, Q = (_randn(generator, *shape) for shape in ((17, 23), (17, 23), (17, 3), (23, 3)))
    expected = M.double() + E.double() - torch.einsum("ik,jk->ij", P.double(), Q.double())
    original_E = E.clone()
    returned = tk.error_feedback_update(M, E, P, Q)
    assert returned is E
    torch.testing.assert_close(E.double(), expected, rtol=1e-5, atol=1e-5)
    out = torch.empty_like(M)
    tk.error_feedback_update(M, original_E.clone(), P, Q, out=out)
    torch.testing.assert_close(out, E, rtol=0, atol=0)


def test_error_feedback_update_of_an_exact_low_rank_gradient_leaves_only_the_old_error():
    # M = P·Qᵀ exactly (small integers): E_new = E
    P = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]])
    Q = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    M = torch.tensor([[2.0, 3.0], [0.0, -1.0], [6.0, 4.0]])
    E = torch.tensor([[0.5, -0.5], [1.0, 0.0], [0.0, 2.0]])
    assert torch.equal(tk.error_feedback_update(M, E.clone(), P, Q), E)


def test_error_feedback_update_float16_rounds_once_from_float32():
    generator = torch.Generator().manual_seed(1)
    M, E, P, Q = (_randn(generator, *shape, dtype=torch.float16) for shape in ((9, 11), (9, 11), (9, 4), (11, 4)))
    expected = (M.float() + E.float() - P.float() @ Q.float().T).half()
    assert torch.equal(tk.error_feedback_update(M, E, P, Q), expected)


@pytest.mark.parametrize("bad, message", [
    (lambda M, E, P, Q: (M.T, E.T, P, Q), "contiguous"),
    (lambda M, E, P, Q: (M, E[:-1], P, Q), "'E' must have M's shape"),
    (lambda M, E, P, Q: (M, E, P[:-1], Q), "'P' must have shape (n, r)"),
    (lambda M, E, P, Q: (M, E, P, Q[:-1]), "'Q' must have shape (m, r)"),
    (lambda M, E, P, Q: (M, E, torch.zeros(6, 33), torch.zeros(6, 33)), "1 <= r <= 32"),
    (lambda M, E, P, Q: (M.bfloat16(), E, P, Q), "float16, float32"),
    (lambda M, E, P, Q: (M, E.half(), P, Q), "'E' must have M's dtype"),
])
def test_error_feedback_update_rejects_bad_arguments(bad, message):
    M, E, P, Q = torch.zeros(6, 6), torch.zeros(6, 6), torch.zeros(6, 3), torch.zeros(6, 3)
    with pytest.raises(ConfigError, match="error_feedback_update") as raised:
        tk.error_feedback_update(*bad(M, E, P, Q))
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_sign_pack_by_hand():
    # signs + - + - +(0) + - + | +   ->   bits 1,0,1,0,1,1,0,1 = 1+4+16+32+128 = 181; then 1
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, 5.0, -6.0, 7.0, 8.0])
    packed, scale = tk.sign_pack(x)
    assert packed.dtype == torch.uint8 and packed.tolist() == [181, 1]
    assert scale.item() == 36 / 9
    assert tk.sign_unpack(packed, scale, 9).tolist() == [4.0, -4.0, 4.0, -4.0, 4.0, 4.0, -4.0, 4.0, 4.0]


@pytest.mark.parametrize("shape, dtype", [((5, 7), torch.float32), ((64,), torch.float32), ((3, 3, 3), torch.float16)])
def test_sign_round_trip_is_scale_times_sign(shape, dtype):
    x = _randn(torch.Generator().manual_seed(3), *shape, dtype=dtype)
    x.view(-1)[0] = 0.0
    packed, scale = tk.sign_pack(x)
    assert scale.item() == pytest.approx(x.double().abs().sum().item() / x.numel(), rel=1e-6)
    signs = torch.where(x.reshape(-1) >= 0, 1.0, -1.0)
    torch.testing.assert_close(tk.sign_unpack(packed, scale, x.numel()), scale * signs)


def test_sign_pack_and_unpack_every_byte_value():
    # element 8b + i is >= 0 exactly when bit i of b is set: the packed bytes are 0, 1, ..., 255
    bits = [(b >> i) & 1 for b in range(256) for i in range(8)]
    x = torch.tensor([1.0 if bit else -1.0 for bit in bits])
    packed, scale = tk.sign_pack(x)
    assert packed.tolist() == list(range(256)) and scale.item() == 1.0
    assert tk.sign_unpack(packed, 2.0, 2045).tolist() == [2.0 if bit else -2.0 for bit in bits[:2045]]


def test_sign_scale_is_accurate_on_a_large_tensor():
    x = torch.randn(12_000_000, generator=torch.Generator().manual_seed(8))
    exact = x.double().abs().sum().item() / x.numel()
    assert tk.sign_pack(x)[1].item() == pytest.approx(exact, rel=1e-6)


def test_sign_majority_unpack_by_brute_force():
    generator = torch.Generator().manual_seed(4)
    numel, world = 13, 4
    per_rank = [torch.randn(numel, generator=generator) for _ in range(world)]
    packed = torch.stack([tk.sign_pack(x)[0] for x in per_rank])
    expected = []
    for i in range(numel):
        votes = sum(1 if x[i] >= 0 else -1 for x in per_rank)
        expected.append(0.0 if votes == 0 else math.copysign(1.0, votes))
    assert tk.sign_majority_unpack(packed, numel).tolist() == expected
    assert 0.0 in expected  # the seed produces at least one tie among 4 ranks


@pytest.mark.parametrize("call, message", [
    (lambda: tk.sign_unpack(torch.zeros(2, dtype=torch.uint8), 1.0, 17), "ceil(numel / 8) = 3"),
    (lambda: tk.sign_unpack(torch.zeros(2), 1.0, 9), "'packed' must be uint8"),
    (lambda: tk.sign_unpack(torch.zeros(2, dtype=torch.uint8), 1.0, 9, torch.int32), "'dtype' must be one of"),
    (lambda: tk.sign_unpack(torch.zeros(2, dtype=torch.uint8), float("nan"), 9), "'scale' must be a finite"),
    (lambda: tk.sign_majority_unpack(torch.zeros(2, dtype=torch.uint8), 9), "(world, bytes)"),
    (lambda: tk.sign_pack(torch.zeros(0)), "at least one element"),
])
def test_sign_functions_reject_bad_arguments(call, message):
    with pytest.raises(ConfigError) as raised:
        call()
    assert message in str(raised.value)


def test_count_above_by_hand():
    x = torch.tensor([-3.0, 1.0, 2.0, -0.5, 1.0])
    assert tk.count_above(x, 1.0).item() == 4
    assert tk.count_above(x, torch.tensor([2.5])).item() == 1


def test_topk_threshold_from_the_whole_tensor_is_the_kth_magnitude():
    x = torch.tensor([0.5, -3.0, 2.0, -1.0, 4.0])
    assert tk.topk_threshold(x, 2, samples=5).item() == 3.0
    assert tk.topk_threshold(x, 4).item() == 1.0  # default samples exceed numel: exact


def test_topk_threshold_count_spread_matches_the_documented_accuracy():
    # s = 2000 of N = 20000, k = 200: j = s·k/N = 20 sample hits, relative std of the count 1/sqrt(20)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(5))
    counts = torch.tensor([reference.count_above(x, reference.topk_threshold(x, 200, 2000, seed)).item()
                           for seed in range(40)], dtype=torch.float64)
    relative = counts / 200
    assert abs(relative.mean().item() - 1) < 0.12
    assert 0.7 < relative.std().item() * math.sqrt(20) < 1.3


def test_topk_by_threshold_reference_by_brute_force():
    x = _distinct_magnitudes(torch.Generator().manual_seed(6), 40, torch.float32).reshape(5, 8)
    values, indices = tk.topk_by_threshold(x, 6)
    order = sorted(range(40), key=lambda i: -abs(x.reshape(-1)[i].item()))[:6]
    assert indices.tolist() == order
    assert values.tolist() == [x.reshape(-1)[i].item() for i in order]


@pytest.mark.parametrize("samples, seed", [(1000, 3), (1, "miss")])
def test_topk_by_threshold_reference_matches_torch_topk_on_the_sampled_path(samples, seed):
    x = _distinct_magnitudes(torch.Generator().manual_seed(7), 2000, torch.float32)
    if seed == "miss":  # the one sample lands on a spike: too few candidates, the whole tensor is used
        x[0], seed = 5000.0, _seed_sampling_index(2000, 0)
    values, indices = tk.topk_by_threshold(x, 50, samples, seed)
    expected = torch.topk(x.abs(), 50).indices
    assert indices.tolist() == expected.tolist()
    assert torch.equal(values, x[expected])


@pytest.mark.parametrize("call, message", [
    (lambda x: tk.topk_threshold(x, 0), "'k' must be an integer >= 1"),
    (lambda x: tk.topk_by_threshold(x, 11), "'k' must be at most numel = 10"),
    (lambda x: tk.topk_threshold(x, 2, samples=0), "'samples' must be an integer >= 1"),
    (lambda x: tk.topk_threshold(x, 2, seed=0.5), "'seed' must be an integer"),
    (lambda x: tk.count_above(x, torch.ones(2)), "one-element tensor"),
])
def test_topk_functions_reject_bad_arguments(call, message):
    with pytest.raises(ConfigError) as raised:
        call(torch.ones(10))
    assert message in str(raised.value)


@pytest.mark.parametrize("name", ["ef_float32_40x150_r3", "sign_pack_float16", "sign_unpack_float32",
                                  "sign_majority_5_ranks", "count_above_float32", "topk_threshold_float32",
                                  "topk_by_threshold_float32"])
def test_dispatcher_uses_the_torch_reference_on_cpu(name, monkeypatch):
    function, args, kwargs = _copy(CASES[name])
    assert tk.backend(*(a for a in args if isinstance(a, torch.Tensor))) == "torch"
    calls = []
    monkeypatch.setattr(reference, function, lambda *a, **k: calls.append(function) or "from the reference")
    assert getattr(tk, function)(*args, **kwargs) == "from the reference"
    assert calls == [function]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference_on_gpu(name):
    function, args, kwargs = _to(_copy(CASES[name]), "cuda")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert tk.backend(*tensors) == "triton"
    result = getattr(tk, function)(*args, **kwargs)
    _assert_matches((result, (args, kwargs)), _reference_call(name, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, rank", [((768, 3072), 4), ((3072, 768), 32), ((30522, 768), 4), ((768, 768), 4),
                                         ((100, 300), 3)])
def test_error_feedback_update_on_gpu_at_bert_sizes(shape, rank, dtype):
    """BERT-Base's matrices, and a small one whose tiles are cut at both edges."""
    generator = torch.Generator().manual_seed(7)
    n, m = shape
    M, E, P, Q = (_randn(generator, *s, dtype=dtype).cuda() for s in ((n, m), (n, m), (n, rank), (m, rank)))
    expected = (M.double() + E.double() - P.double() @ Q.double().T).to(dtype)
    torch.testing.assert_close(tk.error_feedback_update(M, E, P, Q), expected, **TOLERANCE[dtype])


@pytest.mark.gpu
def test_topk_by_threshold_on_gpu_matches_torch_topk():
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(8)).cuda()
    values, indices = tk.topk_by_threshold(x, 2000)
    expected = torch.topk(x.abs(), 2000)
    assert torch.equal(indices, expected.indices)
    assert torch.equal(values, x[expected.indices])
    count = tk.count_above(x, tk.topk_threshold(x, 2000)).item()
    assert abs(count / 2000 - 1) < 0.3  # default s: relative std about 6%


def test_tile_sweep_table_gives_each_configuration_its_time_and_fraction_of_copy():
    from benchmarks import triton_kernels as bench

    rows = [{"shape": (768, 768), "dtype": torch.float32, "copy": 6e-6,
             "seconds": {(1024, 4): 7.5e-6, (4096, 4): 12e-6}}]
    header, rule, line = bench.tile_table(rows)
    assert header == "| matrix | dtype | copy µs | 1024 / 4 warps | 4096 / 4 warps |"
    assert rule.count("---") == 5
    assert line == "| 768×768 | float32 | 6.0 | 7.5 (80%) | 12.0 (50%) |"


if __name__ == "__main__":
    run_cases_interpreted(*sys.argv[1:])

