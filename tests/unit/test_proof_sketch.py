"""The proof's gradient sketch <g, R> of a large float32 gradient keeps float64 accuracy: summed in
float32, its rounding alone reached the float32 bound (1e-3) on a GPT-2 vocabulary (50,257 x 768) and
parallelize refused an exact split."""
import torch

from shardtorch.nn.whole_model import proof


def test_sketch_of_a_vocabulary_sized_float32_gradient_is_float64_accurate():
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(50257, 768, generator=generator, dtype=torch.float64)
    grad[:100] *= 50.0  # a few rows dominate, as the probe tokens' embedding rows do
    factors = proof._factors("transformer.wte.weight", grad.shape, grad.device)
    exact_dot = factors[0] @ grad @ factors[1]  # written out in float64
    exact_square = (grad * grad).sum()
    dot, square = proof._sketch(grad.to(torch.float32), factors)
    norm = exact_square.sqrt()
    # What is left is the float32 rounding of the gradient's entries themselves (about 6e-8 relative).
    assert abs(dot - exact_dot) / norm < 1e-6, (abs(dot - exact_dot) / norm).item()
    assert abs(square - exact_square) / exact_square < 1e-6


def test_sketch_of_a_split_gradient_adds_up_to_the_whole_ones():
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(7, 5, 3, generator=generator, dtype=torch.float64)
    factors = proof._factors("w", grad.shape, grad.device)
    whole = proof._sketch(grad, factors)
    parts = sum(proof._sketch(grad[:, lo:hi], [factors[0], factors[1][lo:hi], factors[2]])
                for lo, hi in ((0, 2), (2, 5)))
    expected = torch.einsum("ijk,i,j,k->", grad, *factors)
    assert torch.allclose(whole[0], expected, rtol=1e-12) and torch.allclose(parts, whole, rtol=1e-12)
    scalar = proof._sketch(torch.tensor(3.0), [])
    assert scalar.tolist() == [3.0, 9.0]
