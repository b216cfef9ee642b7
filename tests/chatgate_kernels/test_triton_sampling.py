"""The sampler's counter-based noise: Triton (on CPU under ``TRITON_INTERPRET=1``) against the
torch reference, and the reference's own distribution."""

import pytest
import torch

pytest.importorskip("triton")

from chatgate_kernels import reference, triton_sampling  # noqa: E402


@pytest.mark.parametrize("vocab", [1, 1000, 2049])
def test_triton_noise_equals_the_reference(vocab: int) -> None:
    """Same integer hash on both sides (a different hash bit would move a value by far more
    than the tolerance); only the float32 logarithm may round differently."""
    keys = torch.tensor([0, 1, 2**31, 2**32 - 1, 987654321])
    got = triton_sampling.exponential_noise(keys, vocab)
    want = reference.exponential_noise(keys, vocab)
    torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_reference_noise_is_exponential_and_keyed() -> None:
    noise = reference.exponential_noise(torch.arange(64), 4096)
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    assert float(torch.corrcoef(noise[:8]).fill_diagonal_(0).abs().max()) < 0.05
    assert torch.equal(reference.exponential_noise(torch.tensor([7]), 4096)[0], noise[7])


def test_noise_is_positive_even_at_the_largest_uniform() -> None:
    """Key 0 over 2**24 columns reaches the largest uniform, 1 - 2**-24: its noise must stay
    above 0 (a 0 would make a zero-probability token's ``p / E`` NaN, which argmax picks)."""
    noise = reference.exponential_noise(torch.tensor([0]), 1 << 24)
    assert float(noise.min()) == pytest.approx(2.0**-24, rel=0.01)
    assert bool(torch.isfinite(noise).all())
