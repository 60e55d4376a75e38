"""training/train_feature_head.py: the positions it trains on line each feature up with the token
after it and the two tokens the head must propose, and step 2 reads step 1's own estimate."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import train_feature_head  # noqa: E402

from specbatch.fast.drafts.feature_draft import FeatureHeadNet, feature_head_config  # noqa: E402
from tests.hf_models import tiny  # noqa: E402


def test_positions_pair_f_before_each_token_with_the_next_two_tokens():
    ids = [7, 8, 9, 10, 11, 12]  # prompt 7 8 9, answer 10 11 12
    features = {"a": torch.arange(6, dtype=torch.float16)[:, None].repeat(1, 3)}  # f_j = j
    feats, token, nxt, after = train_feature_head.positions([("a", ids, 3)], features)
    # j = 2, 3, 4: the head reads f_{j-1} and t_j and proposes t_{j+1} (then t_{j+2} at step 2)
    assert feats[:, 0].tolist() == [1, 2, 3]
    assert token.tolist() == [9, 10, 11] and nxt.tolist() == [10, 11, 12] and after.tolist() == [11, 12, -1]
    short = train_feature_head.positions([("a", ids, 3), ("b", [1, 2], 1)], {**features, "b": features["a"][:2]})
    assert len(short[0]) == 3  # an example with no position to train is skipped


def test_step_two_reads_step_one_estimate_and_the_next_token():
    target = tiny("llama", layers=1, seed=3)
    net = FeatureHeadNet(feature_head_config(target.config, 16)).double()
    embedding, head = target.get_input_embeddings(), target.get_output_embeddings().weight[:20]
    feats = torch.randn(4, target.config.hidden_size, dtype=torch.float64)
    token, nxt = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])
    with torch.no_grad():
        first, second = train_feature_head.two_steps(net, embedding, head, feats, token, nxt)
        estimate = net(embedding(token), feats)
        torch.testing.assert_close(first, estimate @ head.T)
        torch.testing.assert_close(second, net(embedding(nxt), estimate) @ head.T)


def test_the_log_keeps_the_weights_of_the_best_validation():
    from target_features import log_step
    net = torch.nn.Linear(2, 2)
    scores = iter([(0.3, 0.1), (0.5, 0.2), (0.4, 0.3)])
    best, log = (-1.0, None, None), []
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            net.weight.fill_(step)
        best = log_step(dict(step=step), log, net, best, lambda: next(scores), validating=step != 3)
    assert [e.get("validation_step1") for e in log] == [0.3, 0.5, None, 0.4]
    assert best[:2] == (0.5, 2) and best[2]["weight"].eq(2).all()  # a copy, not the live weights
