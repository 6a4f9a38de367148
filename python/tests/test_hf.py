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


def test_accum_dtype_of_a_bf16_model_keeps_no_float32_lm_head_gradient(made_like):
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config("llama")).bfloat16()
    default = mt.patch(copy.deepcopy(reference))
    low = mt.patch(copy.deepcopy(reference), accum_dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (2, 9))
    seen = []  # whether a float32 tensor of lm_head's shape was made
    for model in (default, low):
        made = made_like(model.lm_head.weight.shape,
                         lambda: model(ids, labels=ids).loss.backward())
        seen.append(any(dtype == torch.float32 for _, dtype in made))
    assert seen == [True, False]
    # One chunk (18 rows) and an upstream of 1: the same rounding (test_torch.py says why).
    assert torch.equal(low.lm_head.weight.grad, default.lm_head.weight.grad)
    with pytest.raises(TypeError, match="accum_dtype must be None or a torch.dtype, got 'bf16'"):
        mt.patch(copy.deepcopy(reference), accum_dtype="bf16")
    with pytest.raises(ValueError, match="accum_dtype is the fused loss's"):
        mt.patch(copy.deepcopy(reference), fused_linear_cross_entropy=False,
                 accum_dtype=torch.bfloat16)


def test_patch_swaps_the_modules_and_refuses_other_architectures():
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    mt.patch(model)
    assert model.model.norm.forward.__func__.__module__ == "meshfuse.hf"
    assert model.model.layers[0].mlp.forward.__func__.__module__ == "meshfuse.hf"
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        mt.patch(transformers.AutoModelForCausalLM.from_config(gpt2))


def _pair(name, seed=0):
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(_config(name))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    return reference, mt.patch(copy.deepcopy(reference)), ids, labels


def test_evaluation_and_no_grad_give_the_logits_and_the_same_loss():
    # HF Trainer's evaluation and prediction (eval mode, no_grad), compute_metrics and perplexity
    # scripts pass labels and read the logits: only a training step takes the fused loss.
    reference, patched, ids, labels = _pair("llama")
    with torch.no_grad():  # training mode, no grad
        ours, theirs = patched(ids, labels=labels), reference(ids, labels=labels)
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    patched.eval()
    reference.eval()
    ours, theirs = patched(ids, labels=labels), reference(ids, labels=labels)  # eval, grad on
    assert ours.logits is not None
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    patched.train()
    fused = patched(ids, labels=labels)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, theirs.loss, rtol=1e-5, atol=1e-6)


def test_return_dict_false_gives_transformers_tuple():
    reference, patched, ids, labels = _pair("qwen2")
    ours = patched(ids, labels=labels, return_dict=False)
    theirs = reference(ids, labels=labels, return_dict=False)
    assert isinstance(ours, tuple)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    # The logits (theirs[1]) are not made: None in their place, every other field where it was.
    assert len(ours) == len(theirs) and ours[1] is None
    for a, b in zip(ours[2:], theirs[2:]):
        assert type(a) is type(b)
    patched.eval()
    torch.testing.assert_close(patched(ids, return_dict=False)[0],
                               reference(ids, return_dict=False)[0], rtol=1e-5, atol=1e-5)


def test_mixtral_router_logits_asked_in_the_call_keep_mixtrals_loss():
    reference, patched, ids, labels = _pair("mixtral")
    ours = patched(ids, labels=labels, output_router_logits=True)
    theirs = reference(ids, labels=labels, output_router_logits=True)
    assert type(ours) is type(theirs) and ours.router_logits is not None
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-6)
    fused = patched(ids, labels=labels)  # without: the fused loss, in Mixtral's output class
    assert type(fused) is type(theirs) and fused.logits is None
    torch.testing.assert_close(fused.loss, reference(ids, labels=labels).loss, rtol=1e-5,
                               atol=1e-6)


def test_patch_keeps_the_forward_it_replaces_and_refuses_accelerate_hooks():
    reference, patched, ids, labels = _pair("mistral")
    calls = []
    model = copy.deepcopy(reference)
    own = model.forward

    def wrapped(*args, **kwargs):  # an instance forward that was there before (a wrapper)
        calls.append(kwargs.get("labels") is not None)
        return own(*args, **kwargs)

    model.forward = wrapped
    mt.patch(model)
    model(ids)  # without labels: the forward it had
    assert calls == [False]
    model(ids, labels=labels).loss.backward()  # the fused loss
    assert calls == [False]
    # A copy's fallbacks call the copy's forwards, not the original's.
    twin = copy.deepcopy(patched)
    assert twin.model.norm._meshfuse_unpatched_forward.__self__ is twin.model.norm
    assert twin._meshfuse_unpatched_forward.__self__ is twin

    # accelerate's add_hook_to_module (a device_map= or offloaded model): the hook is the
    # instance's forward and reads _hf_hook; patch refuses before changing anything.
    hooked = copy.deepcopy(reference)
    hooked.model.layers[0].mlp._hf_hook = object()
    with pytest.raises(ValueError, match="'model.layers.0.mlp' has accelerate hooks"):
        mt.patch(hooked)
    assert "forward" not in vars(hooked.model.norm)


class _LoraLinear(torch.nn.Module):
    # As peft's LoRA layer: weight and bias are the base layer's, the output adds B(A(x)).
    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.b = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.b.weight, std=0.5)

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


def test_lora_adapters_and_hooks_on_the_projections_and_lm_head_take_part():
    # The patched MLP and loss once read gate_proj.weight and lm_head.weight directly: the
    # adapters and hooks were skipped, and the patched model's loss silently differed.
    reference, _, ids, labels = _pair("llama")
    mlp = reference.model.layers[0].mlp
    mlp.gate_proj = _LoraLinear(mlp.gate_proj)
    reference.lm_head = _LoraLinear(reference.lm_head)
    patched = mt.patch(copy.deepcopy(reference))
    calls = []
    patched.model.layers[1].mlp.up_proj.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, rtol=1e-5,
                                   atol=1e-5)
    assert calls == [1]
    ours, theirs = patched(ids, labels=labels), reference(ids, labels=labels)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    ours.loss.backward()
    theirs.loss.backward()
    for (n, p), q in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_swiglu_mlp_module_calls_its_projections():
    torch.manual_seed(1)
    mlp = mt.SwiGLUMLP(8, 12)
    mlp.up_proj = _LoraLinear(mlp.up_proj)
    x = torch.randn(3, 8)
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


def test_a_patched_model_keeps_the_signature_transformers_reads():
    # The patched forward showed (*args, **kwargs): generate() then built no attention mask from
    # the pad tokens (other tokens than the unpatched model's, silently), and Trainer's column
    # filter kept only the labels of a batch.
    import inspect
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    patched = mt.patch(copy.deepcopy(reference))
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)
    assert inspect.signature(patched.model.norm.forward) == \
        inspect.signature(reference.model.norm.forward)
    ids = torch.randint(1, 64, (2, 6))
    ids[0, :2] = 0  # left padding
    for model in (patched, reference):
        model.eval()
        model.generation_config.pad_token_id = 0
    kwargs = dict(max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(patched.generate(ids, **kwargs), reference.generate(ids, **kwargs),
                               rtol=0, atol=0)


def test_losses_the_fused_path_cannot_give_take_the_models_own_forward():
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()

    # A loss function of the caller's (transformers' public setter): it was ignored.
    def smoothed(logits, labels, vocab_size, **kwargs):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab_size).float(), labels[:, 1:].reshape(-1),
            label_smoothing=0.1)

    custom = copy.deepcopy(reference)
    custom.loss_function = smoothed
    patched = mt.patch(copy.deepcopy(custom))
    torch.testing.assert_close(patched(ids, labels=labels).loss, custom(ids, labels=labels).loss)
    # Another ignore_index (transformers' loss takes it from the call): ignored before.
    patched = mt.patch(copy.deepcopy(reference))
    torch.testing.assert_close(patched(ids, labels=labels, ignore_index=7).loss,
                               reference(ids, labels=labels, ignore_index=7).loss)
    # Logits kept at the last positions only, with labels for those: a shape error before.
    patched = mt.patch(copy.deepcopy(reference))
    kept = dict(labels=labels[:, -5:], logits_to_keep=5)
    torch.testing.assert_close(patched(ids, **kept).loss, reference(ids, **kept).loss)
    # A bf16 model whose lm_head stayed fp32, under autocast: a dtype error before.
    mixed = copy.deepcopy(reference).to(torch.bfloat16)
    mixed.lm_head.float()
    patched = mt.patch(copy.deepcopy(mixed))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = patched(ids, labels=labels).loss, mixed(ids, labels=labels).loss
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    ours.backward()
    assert patched.lm_head.weight.grad.dtype == torch.float32


def test_a_patched_model_saved_whole_loads_as_a_working_model():
    # Loading failed: pickle rebinds a bound method by its function's name ('_mlp_forward').
    import io
    torch.manual_seed(0)
    patched = mt.patch(transformers.AutoModelForCausalLM.from_config(_config("llama")))
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, patched.eval()(ids).logits)


def test_a_patched_model_compiles_with_fullgraph_and_gives_the_eager_loss():
    # The output class's fields were read with dataclasses.fields inside the forward, where
    # dynamo's fullgraph tracing stops: they are found when patching.
    torch.manual_seed(0)
    model = mt.patch(transformers.AutoModelForCausalLM.from_config(_config("llama")))
    ids = torch.randint(0, 64, (2, 9))
    eager = model(ids, labels=ids).loss
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, labels=ids).loss
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
