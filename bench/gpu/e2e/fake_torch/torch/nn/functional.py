"""Shape-only stand-ins for torch.nn.functional."""
from .. import Tensor


def scaled_dot_product_attention(q, k, v, is_causal=False):
    return Tensor(q.shape)


def gelu(x):
    return x


def cross_entropy(logits, target):
    return Tensor(())
