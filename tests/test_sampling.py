"""Sampling continuations from a GPT: seeded determinism, top-k = 1 is greedy, context cropping, myopic twins."""

import pytest
import torch

from ntpflow.model.config import GPTConfig
from ntpflow.model.gpt import GPT
from ntpflow.model.sampling import next_token_probs, sample


def _model(myopic="none", n_ctx=8, seed=0):
    # float64: the tests compare token choices of forwards that sum in different orders (vanilla vs myopic attention,
    # cropped vs full prompt); their logits then differ by ~1e-15, far below any gap a greedy or sampled pick meets
    return GPT(GPTConfig(vocab_size=11, n_ctx=n_ctx, n_layer=2, n_head=2, d_model=16, myopic=myopic),
               seed=seed).double()


def test_seeded_sampling_is_deterministic_and_seed_dependent():
    m = _model()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    a = sample(m, prompt, 12, temperature=1.5, generator=torch.Generator().manual_seed(7))
    b = sample(m, prompt, 12, temperature=1.5, generator=torch.Generator().manual_seed(7))
    c = sample(m, prompt, 12, temperature=1.5, generator=torch.Generator().manual_seed(8))
    assert a.shape == (2, 15) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(a[:, :3], prompt)
    assert int(a.min()) >= 0 and int(a.max()) < 11


def test_top_k_one_equals_independent_greedy_argmax():
    m = _model(seed=3)
    prompt = [5, 1, 7]
    got = sample(m, prompt, 10, top_k=1, temperature=0.9, generator=torch.Generator().manual_seed(0))
    # greedy computed independently: full forward on the growing sequence, argmax of the last logits
    seq = list(prompt)
    with torch.no_grad():
        m.eval()
        for _ in range(10):
            ctx = torch.tensor([seq[-m.cfg.n_ctx:]])
            seq.append(int(m(ctx)[0, -1].argmax()))
    assert got.tolist() == seq
    assert sample(m, prompt, 10, greedy=True).tolist() == seq


def test_context_is_cropped_to_n_ctx():
    m = _model(n_ctx=8)
    prompt = torch.arange(20) % 11  # longer than n_ctx
    out = sample(m, prompt, 5, greedy=True)
    assert out.shape == (25,)
    # the continuation depends only on the last n_ctx tokens
    same_tail = torch.cat([torch.zeros(12, dtype=torch.long), prompt[-8:]])
    assert torch.equal(sample(m, same_tail, 5, greedy=True)[-5:], out[-5:])
    # and equals greedy decoding on the cropped prompt
    assert torch.equal(sample(m, prompt[-8:], 5, greedy=True)[-5:], out[-5:])


def test_myopic_model_samples_like_its_vanilla_twin():
    van, myo = _model("none", seed=2), _model("kv", seed=2)
    gen = [torch.Generator().manual_seed(5) for _ in range(2)]
    assert torch.equal(sample(van, [1, 2], 9, generator=gen[0]), sample(myo, [1, 2], 9, generator=gen[1]))


def test_top_k_probs_and_bad_inputs():
    p = next_token_probs(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), temperature=1.0, top_k=2)
    assert p[0, 0] == 0 and p[0, 2] == 0 and torch.allclose(p.sum(), torch.tensor(1.0))
    m = _model()
    was_training = m.training
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        sample(m, [1], 3)
    with pytest.raises(ValueError, match="temperature"):
        sample(m, [1], 3, temperature=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="token ids"):
        sample(m, [11], 3, greedy=True)
    with pytest.raises(ValueError, match="prompt must be"):
        sample(m, torch.zeros(2, 0, dtype=torch.long), 3, greedy=True)
    assert m.training == was_training
