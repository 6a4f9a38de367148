"""meshfuse.torch.patch on tiny random-initialised transformers models (no weights downloaded):
logits, loss and every gradient of one training step against the unpatched model (skipped
without torch or transformers)."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import meshfuse.torch as mt  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _config(name):
    configs = {
        "llama": lambda: transformers.LlamaConfig(**SIZES),
        "mistral": lambda: transformers.MistralConfig(**SIZES),
        "qwen2": lambda: transformers.Qwen2Config(**SIZES),
        "mixtral": lambda: transformers.MixtralConfig(**SIZES, num_local_experts=2,
                                                      num_experts_per_tok=1),
    }
    return configs[name]()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "mixtral"])
def test_a_patched_model_gives_the_unpatched_logits_loss_and_gradients(name):
    torch.manual_seed(0)
    # float32: Mixtral's grouped expert GEMM has no double.
    reference = transformers.AutoModelForCausalLM.from_config(_config(name))
    patched = mt.patch(copy.deepcopy(reference))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100

    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, rtol=1e-5,
                                   atol=1e-5)
    ours, theirs = patched(ids, labels=labels), reference(ids, labels=labels)
    assert ours.logits is None  # the fused loss makes no (tokens, vocabulary) logits
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    ours.loss.backward()
    theirs.loss.backward()
    for (n, p), q in zip(patched.named_parameters(), reference.parameters()):
        if q.grad is None:  # an expert no token was routed to
            assert p.grad is None or not p.grad.any(), n
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    # num_items_in_batch: a sum over the batch divided by it, as transformers' loss.
    items = torch.tensor(11.0)
    torch.testing.assert_close(patched(ids, labels=labels, num_items_in_batch=items).loss,
                               reference(ids, labels=labels, num_items_in_batch=items).loss,
                               rtol=1e-5, atol=1e-6)


def test_patch_swaps_the_modules_and_refuses_other_architectures():
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    mt.patch(model)
    assert model.model.norm.forward.__func__.__module__ == "meshfuse.hf"
    assert model.model.layers[0].mlp.forward.__func__.__module__ == "meshfuse.hf"
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        mt.patch(transformers.AutoModelForCausalLM.from_config(gpt2))
