"""Tiny, random-init versions of the architectures people actually convert, built in code (no downloads).

``REAL_MODELS[name]`` is a :class:`RealModel`: ``build()`` returns a fresh, seeded fp32 model in eval mode,
``make_inputs(size)`` the positional inputs for a batch of ``size`` (the node count for a PyG graph),
deterministic for a given size, and ``output(result)`` the tensor the numerical checks compare (logits,
last hidden state, segmentation map, sorted detection scores). Models in the training subset also carry
``loss_fn(output, label)`` and ``make_label(size)``.

Families: Hugging Face transformers (eager and sdpa attention), torchvision (classification, segmentation, optical flow,
detection), timm, PyTorch Geometric, and plain ``torch.nn`` recurrent/attention modules. torchvision is
imported through ``models.torchvision_ops`` (the CUDA wheel that matches the torch pin lacks its C ops
on the CPU build: the missing ``torchvision::nms`` schemas are defined there, with a small CPU nms).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # models/ is not installed

from models.torchvision_ops import import_torchvision  # noqa: E402  (before transformers/timm import it)

torchvision = import_torchvision()

SEED = 0
TEXT_LENGTH = 8
VOCAB = 96
IMAGE = 32
PYG_FEATURES, PYG_CLASSES = 64, 7


@dataclass(frozen=True)
class RealModel:
    name: str
    family: str                                    # transformers, torchvision, timm, pyg, diffusers, torch.nn
    builder: Callable[[], nn.Module]
    make_inputs: Callable[[int], tuple]            # size (batch, or graph node count) -> positional inputs
    output: Callable[[Any], torch.Tensor]          # model output -> the tensor compared numerically
    sizes: tuple[int, int] = (2, 3)                # conversion size, and a second size to call with
    loss_fn: Callable | None = None                # training subset: loss_fn(output, label)
    make_label: Callable[[int], torch.Tensor] | None = None

    def build(self) -> nn.Module:
        """A fresh fp32 model in eval mode; the same weights every call, the global RNG untouched.
        Batch-norm statistics are calibrated on a batch of inputs (see calibrate_batch_norm)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = self.builder().float().eval()
            if self.name not in _CALIBRATED:
                _CALIBRATED[self.name] = calibrate_batch_norm(model, self.make_inputs(CALIBRATION_SIZE))
            if _CALIBRATED[self.name]:
                model.load_state_dict(_CALIBRATED[self.name], strict=False)
        return model

    def inputs(self, size: int | None = None) -> tuple:
        return self.make_inputs(self.sizes[0] if size is None else size)


CALIBRATION_SIZE = 32
_CALIBRATED: dict[str, dict[str, torch.Tensor]] = {}


def calibrate_batch_norm(model: nn.Module, inputs: tuple) -> dict[str, torch.Tensor]:
    """Set every batch norm's running statistics to those of the activations on `inputs`, as training
    would; returns them (a state_dict subset). With freshly initialised statistics (mean 0, variance 1)
    deep random-init CNNs shrink their activations layer after layer (MobileNetV3's logits ~1e-10,
    EfficientNet's ~1e-13): below fp16's range, so every error comparison would be vacuous."""
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats}
    if not norms:
        return {}
    momenta = {name: module.momentum for name, module in norms.items()}
    for module in norms.values():
        module.reset_running_stats()
        module.momentum, module.training = None, True     # cumulative average over the calibration call
    with torch.no_grad():
        model(*inputs)
    for name, module in norms.items():
        module.momentum, module.training = momenta[name], False
    return {f"{name}.{key}": value.clone() for name, module in norms.items()
            for key, value in module._buffers.items() if value is not None}


def _generator(size: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1_000 * size + salt)


# ---------------------------------------------------------------------------------------------- inputs
def _tokens(size: int, salt: int = 0, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (size, TEXT_LENGTH), generator=_generator(size, salt))


def _padding_mask(size: int) -> torch.Tensor:
    """1 for real tokens; every second sequence has its last two positions padded."""
    mask = torch.ones(size, TEXT_LENGTH, dtype=torch.long)
    mask[1::2, -2:] = 0
    return mask


def text_inputs(size: int) -> tuple:
    return _tokens(size), _padding_mask(size)


def gpt2_inputs(size: int) -> tuple:
    return _tokens(size), None, _padding_mask(size)      # GPT2LMHeadModel.forward(input_ids, cache, attention_mask)


def seq2seq_inputs(size: int) -> tuple:
    return _tokens(size), _padding_mask(size), _tokens(size, salt=1)


def image_inputs(size: int, image: int = IMAGE) -> tuple:
    return (torch.randn(size, 3, image, image, generator=_generator(size)),)


def _image_64(size: int) -> tuple:
    return image_inputs(size, 64)


def detection_inputs(size: int) -> tuple:
    """torchvision detection models take a list of CHW images in [0, 1]."""
    generator = _generator(size)
    return ([torch.rand(3, 96, 96, generator=generator) for _ in range(size)],)


def sequence_inputs(size: int) -> tuple:
    return (torch.randn(size, 6, 16, generator=_generator(size)),)


def attention_inputs(size: int) -> tuple:
    key_padding_mask = torch.zeros(size, TEXT_LENGTH, dtype=torch.bool)
    key_padding_mask[1::2, -2:] = True
    return torch.randn(size, TEXT_LENGTH, 16, generator=_generator(size)), key_padding_mask


def graph_inputs(num_nodes: int) -> tuple:
    """A Cora-like citation graph: binary bag-of-words features, sparse undirected citations."""
    generator = _generator(num_nodes)
    features = (torch.rand(num_nodes, PYG_FEATURES, generator=generator) < 0.1).float()
    num_edges = 2 * num_nodes
    source = torch.randint(num_nodes, (num_edges,), generator=generator)
    target = torch.randint(num_nodes, (num_edges,), generator=generator)
    edge_index = torch.stack([torch.cat([source, target]), torch.cat([target, source])])
    return features, edge_index


# --------------------------------------------------------------------------------------------- outputs
def logits(out) -> torch.Tensor:
    return out.logits


def last_hidden_state(out) -> torch.Tensor:
    return out.last_hidden_state


def segmentation_map(out) -> torch.Tensor:
    return out["out"]


def first(out) -> torch.Tensor:
    return out[0]


def tensor(out) -> torch.Tensor:
    return out


def detection_scores(out) -> torch.Tensor:
    """The top detection scores of each image, sorted: continuous in the inputs (nms never suppresses,
    see _ssdlite), unlike the order of the boxes."""
    return torch.stack([d["scores"].sort(descending=True).values for d in out])


# ---------------------------------------------------------------------------------------- transformers
def _hf(model_class: str, config_class: str, attn: str, **config):
    import transformers
    config = getattr(transformers, config_class)(**config)
    config._attn_implementation = attn
    return getattr(transformers, model_class)(config)


_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=64, type_vocab_size=2)


def _bert(attn: str) -> nn.Module:
    return _hf("BertModel", "BertConfig", attn, **_BERT)


def _bert_classifier() -> nn.Module:
    return _hf("BertForSequenceClassification", "BertConfig", "sdpa", **_BERT, num_labels=3)


def _gpt2(attn: str) -> nn.Module:
    return _hf("GPT2LMHeadModel", "GPT2Config", attn, vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
               n_head=2, use_cache=False)


def _llama() -> nn.Module:
    return _hf("LlamaForCausalLM", "LlamaConfig", "sdpa", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
               use_cache=False)


def _t5() -> nn.Module:
    return _hf("T5ForConditionalGeneration", "T5Config", "eager", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
               num_layers=2, num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=16, decoder_start_token_id=0, pad_token_id=0, use_cache=False)


def _bart() -> nn.Module:
    return _hf("BartModel", "BartConfig", "sdpa", vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
               max_position_embeddings=64, use_cache=False)


def _distilbert() -> nn.Module:
    return _hf("DistilBertModel", "DistilBertConfig", "eager", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2,
               hidden_dim=64, max_position_embeddings=64)


def _deberta_v2() -> nn.Module:
    """Relative-position attention (c2p and p2c); masks with finfo(float32).min, which bf16 cannot hold."""
    return _hf("DebertaV2Model", "DebertaV2Config", "eager", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=128, max_position_embeddings=64, relative_attention=True,
               position_buckets=16, pos_att_type=["p2c", "c2p"])


def _deberta_v3() -> nn.Module:
    """DeBERTa-v3's settings: a LayerNorm of the relative-position table (a parameter as a norm's data input)
    and one key projection shared with it; 8 buckets, so positions beyond 4 take the log-bucket path."""
    return _hf("DebertaV2Model", "DebertaV2Config", "eager", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, relative_attention=True,
               position_buckets=8, max_relative_positions=64, norm_rel_ebd="layer_norm", share_att_key=True,
               pos_att_type=["p2c", "c2p"])


def _vit_hf() -> nn.Module:
    return _hf("ViTForImageClassification", "ViTConfig", "sdpa", image_size=IMAGE, patch_size=8, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=10)


def _clip() -> nn.Module:
    """Text and vision towers, contrastive logits: batch appears on both sides of logits_per_image."""
    return _hf("CLIPModel", "CLIPConfig", "sdpa", projection_dim=16,
               text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2),
               vision_config=dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2))


def clip_inputs(size: int) -> tuple:
    return _tokens(size), torch.randn(size, 3, IMAGE, IMAGE, generator=_generator(size, salt=2))


def logits_per_image(out) -> torch.Tensor:
    return out.logits_per_image


WHISPER_MELS, WHISPER_POSITIONS = 16, 16


def _whisper() -> nn.Module:
    return _hf("WhisperModel", "WhisperConfig", "sdpa", vocab_size=VOCAB, num_mel_bins=WHISPER_MELS, d_model=32,
               encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=WHISPER_POSITIONS,
               max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1, use_cache=False)


def whisper_inputs(size: int) -> tuple:
    # Whisper's encoder wants exactly 2 * max_source_positions frames (its two convolutions halve them once).
    features = torch.randn(size, WHISPER_MELS, 2 * WHISPER_POSITIONS, generator=_generator(size))
    return features, None, _tokens(size, salt=1)



class ArgsWrapper(nn.Module):
    """The wrapper users write around a model, `forward(self, *inputs)`: torch.export's dynamic dims must be
    given by argument name for it, else every dim was fixed and a second batch size failed a guard."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs)

def _wav2vec2() -> nn.Module:
    # Its positional convolution carries a weight_norm parametrization (issue 7, item 7).
    return _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", "eager", vocab_size=32, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
               conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)


def audio_inputs(size: int) -> tuple:
    return (torch.randn(size, 400, generator=_generator(size)),)


def _mixtral() -> nn.Module:
    """Mixture of experts (issue 18): a softmax router picks 2 of 4 experts per token (top-k), the experts'
    outputs are weighted and summed per token; grouped-query attention. transformers' default experts code
    (grouped_mm) runs each expert's matmul as one custom op."""
    return _decisive_routers(_hf("MixtralForCausalLM", "MixtralConfig", "sdpa", vocab_size=VOCAB, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                 max_position_embeddings=64, use_cache=False))


def _qwen2_moe() -> nn.Module:
    """A second mixture of experts: 2 of 8 experts, top-k weights not renormalised, a shared expert behind a
    sigmoid gate, eager attention."""
    return _decisive_routers(_hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "eager", vocab_size=VOCAB, hidden_size=32,
                                 intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 use_cache=False))


def _decisive_routers(model: nn.Module) -> nn.Module:
    """Router weights with std 1 (router logits of a few units, as trained routers give). Random init (std
    0.02) routes every token almost uniformly: the 2nd and 3rd experts' logits 1e-4 apart, so a rounding
    anywhere upstream, autocast's included, sends some tokens to other experts by chance, and a
    comparison of errors compares coin tosses (tests/convert/test_moe.py checks the routing itself)."""
    for layer in model.model.layers:
        nn.init.normal_(layer.mlp.gate.weight, std=1.0)
    return model


# ----------------------------------------------------------------------------------------- torchvision
def _resnet() -> nn.Module:
    return torchvision.models.resnet18(num_classes=10)


def _mobilenet_v3() -> nn.Module:
    return torchvision.models.mobilenet_v3_small(num_classes=10)


def _efficientnet() -> nn.Module:
    return torchvision.models.efficientnet_b0(num_classes=10)


def _convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)],
                    num_classes=10)


def _vit_tv() -> nn.Module:
    model = torchvision.models.VisionTransformer(image_size=IMAGE, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10)
    nn.init.normal_(model.heads.head.weight, std=0.1)   # torchvision zero-initialises the head: outputs all 0
    return model


def _swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
                           num_classes=10)


def _deeplab() -> nn.Module:
    return torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=False)


def _ssdlite() -> nn.Module:
    # nms_thresh 1.0: nothing is suppressed, so the top scores are a continuous function of the inputs.
    model = torchvision.models.detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, detections_per_img=20, topk_candidates=50,
        nms_thresh=1.0)
    model.transform.min_size, model.transform.max_size, model.transform.fixed_size = (96,), 96, (96, 96)
    return model


class FlowUpdates(nn.Module):
    """RAFT with a fixed number of refinement steps (its forward takes num_flow_updates as an argument)."""

    def __init__(self, model: nn.Module, updates: int):
        super().__init__()
        self.model, self.updates = model, updates

    def forward(self, image1, image2):
        return self.model(image1, image2, num_flow_updates=self.updates)


def _raft_small() -> nn.Module:
    # 2 of the default 12 updates keep the suite fast; the coordinates it refines are the class (issue 18).
    return FlowUpdates(torchvision.models.optical_flow.raft_small(weights=None), updates=2)


def _raft_small_two_levels() -> nn.Module:
    """A variant: a 2-level correlation pyramid (images from 32 px instead of 128), 4 updates, 64 x 96 images."""
    from torchvision.models.optical_flow.raft import CorrBlock
    model = torchvision.models.optical_flow.raft_small(weights=None, corr_block=CorrBlock(num_levels=2, radius=3))
    return FlowUpdates(model, updates=4)


def _image_pair(size: int, height: int, width: int) -> tuple:
    """Two frames in [-1, 1] (RAFT's normalisation): the second is the first moved by (2, 3) pixels, plus noise."""
    generator = _generator(size)
    first = torch.rand(size, 3, height, width, generator=generator) * 2 - 1
    second = first.roll((2, 3), dims=(2, 3)) + 0.05 * torch.randn(size, 3, height, width, generator=generator)
    return first, second


def last_flow(out) -> torch.Tensor:
    return out[-1]


# ------------------------------------------------------------------------------------------------ timm
def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return build


# ------------------------------------------------------------------------------------------------- PyG
class TwoLayerGNN(nn.Module):
    """dropout -> conv1 -> activation -> dropout -> conv2 -> log_softmax, as the Cora examples do."""

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.p, training=self.training)
        x = self.activation(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.p, training=self.training)
        return F.log_softmax(self.conv2(x, edge_index), dim=1)


class GCN(TwoLayerGNN):
    """The classic Cora example (Kipf & Welling): two GCNConv layers, dropout, log_softmax."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        from torch_geometric.nn import GCNConv
        self.conv1, self.conv2 = GCNConv(PYG_FEATURES, hidden), GCNConv(hidden, PYG_CLASSES)
        self.p, self.activation = 0.5, F.relu



class GAT(TwoLayerGNN):
    """The Cora GAT example: 4 attention heads, ELU, one averaged output head, log_softmax."""

    def __init__(self, hidden: int = 8, heads: int = 4):
        super().__init__()
        from torch_geometric.nn import GATConv
        self.conv1 = GATConv(PYG_FEATURES, hidden, heads=heads, dropout=0.6)
        self.conv2 = GATConv(hidden * heads, PYG_CLASSES, heads=1, concat=False, dropout=0.6)
        self.p, self.activation = 0.6, F.elu



# -------------------------------------------------------------------------------------------- torch.nn
class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]), h


class GRUTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(16, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out)


class TokenTransformerEncoder(nn.Module):
    """nn.Embedding -> nn.TransformerEncoder -> mean pool -> Linear (issue 7, item 1 broke this at O1)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class SelfAttentionBlock(nn.Module):
    """Linear -> nn.MultiheadAttention (with a key padding mask) -> residual LayerNorm -> Linear."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, key_padding_mask):
        h = self.proj(x)
        attended, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask)
        return self.head(self.norm(h + attended))


class FinfoMaskedAttention(nn.Module):
    """Hand-written attention over a query x key padding mask filled with torch.finfo(torch.float32).min
    (beyond bf16's and fp16's range): padded queries get fully masked rows, a uniform average in fp32 (NaN
    where the fill became -inf)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.qkv = nn.Linear(32, 96)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, tokens, mask):
        h = self.embed(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        keep = mask.bool()
        pairs = keep.unsqueeze(1) & keep.unsqueeze(2)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~pairs, torch.finfo(torch.float32).min)
        return self.head(self.norm(h + torch.softmax(scores, -1) @ v))


# issue 29, training paths: a time-series transformer whose norm is BatchNorm over tokens (PatchTST's
# norm="BatchNorm"): x.transpose(1, 2) -> BatchNorm1d -> transpose back, then a view; the O2 train step's view
# failed on the strides the real batch-norm kernel returns.
class TimeSeriesTokenBatchNorm(nn.Module):
    def __init__(self, channels: int = 3, length: int = 12, width: int = 32, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(channels, width)
        self.position = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm_attn, self.norm_ff = nn.BatchNorm1d(width), nn.BatchNorm1d(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.project = nn.Linear(width, width)   # its output is contiguous: the view below is legal in eager
        self.head = nn.Linear(length * width, classes)

    @staticmethod
    def _token_norm(norm: nn.BatchNorm1d, h: torch.Tensor) -> torch.Tensor:
        return norm(h.transpose(1, 2)).transpose(1, 2)

    def forward(self, x):
        h = self.embed(x) + self.position
        h = self._token_norm(self.norm_attn, h + self.attn(h, h, h, need_weights=False)[0])
        h = self.project(self._token_norm(self.norm_ff, h + self.ff(h)))
        return self.head(h.view(h.shape[0], -1))


def series_inputs(size: int) -> tuple:
    return (torch.randn(size, 12, 3, generator=_generator(size)),)


# issue 29, training paths: a PyG graph classifier pooling with global_mean_pool(x, batch) and no size, which
# reads int(batch.max()) + 1: convert() runs its top level as written with its convolutions and head converted,
# and its O2 train step runs eagerly (fake tensors cannot trace that read).
POOLED_GRAPHS = 4


class PooledGCN(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        from torch_geometric.nn import GCNConv
        self.conv1, self.conv2 = GCNConv(PYG_FEATURES, hidden), GCNConv(hidden, hidden)
        self.head = nn.Linear(hidden, PYG_CLASSES)

    def forward(self, x, edge_index, batch):
        from torch_geometric.nn import global_mean_pool
        h = F.relu(self.conv2(F.relu(self.conv1(x, edge_index)), edge_index))
        return self.head(global_mean_pool(h, batch))


def pooled_graph_inputs(num_nodes: int) -> tuple:
    return (*graph_inputs(num_nodes), torch.arange(num_nodes) * POOLED_GRAPHS // num_nodes)


def _graph_label(size: int) -> torch.Tensor:
    return torch.randint(PYG_CLASSES, (POOLED_GRAPHS,), generator=_generator(size, salt=7))


# ------------------------------------------------------------------------------------------- diffusers
UNET_CHANNELS, UNET_TEXT, UNET_TEXT_DIM = 4, 6, 32


def _unet_conditional() -> nn.Module:
    """The Stable Diffusion denoiser's architecture: GroupNorm, sin/cos timestep embedding, cross-attention."""
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(sample_size=16, in_channels=UNET_CHANNELS, out_channels=UNET_CHANNELS,
                                block_out_channels=(32, 64), layers_per_block=1,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=UNET_TEXT_DIM, attention_head_dim=8, norm_num_groups=8)


def unet_conditional_inputs(size: int) -> tuple:
    generator = _generator(size, salt=3)
    return (torch.randn(size, UNET_CHANNELS, 16, 16, generator=generator),
            torch.randint(0, 1000, (size,), generator=generator),
            torch.randn(size, UNET_TEXT, UNET_TEXT_DIM, generator=generator))


def _unet_unconditional() -> nn.Module:
    """DDPM-style UNet: self-attention only, sin/cos timestep embedding, no text."""
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       attention_head_dim=8, norm_num_groups=8)


def unet_unconditional_inputs(size: int) -> tuple:
    generator = _generator(size, salt=4)
    return torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, 1000, (size,), generator=generator)


def denoised_sample(out) -> torch.Tensor:
    return out.sample


class IndexAddMoE(nn.Module):
    """A mixture of experts written in plain torch (transformers v4's Mixtral): LayerNorm, a softmax router,
    top-2 of 4 GELU experts, each expert's weighted output added into a zeros_like buffer with index_add_."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = 4, top: int = 2):
        super().__init__()
        self.norm, self.router, self.top = nn.LayerNorm(dim), nn.Linear(dim, experts, bias=False), top
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                     for _ in range(experts))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        batch, length, dim = x.shape
        h = self.norm(x).reshape(-1, dim)
        weights, chosen = torch.topk(F.softmax(self.router(h), dim=-1), self.top, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            out.index_add_(0, token, (expert(h[token]) * weights[token, slot, None]).to(out.dtype))
        return self.head(x + out.reshape(batch, length, dim))


# issue 29, numerics of the decisions: a Gemma decoder (its RMSNorm upcasts with x.float(), scales by
# 1 + weight.float() and casts back with type_as) and a plain-torch LM whose RMSNorm and LayerNorm are written
# by hand (no upcast): both train at O2 (fp16 skipped every step while O2 ran their norms' ops low).
def _gemma() -> nn.Module:
    return _hf("GemmaForCausalLM", "GemmaConfig", "sdpa", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               max_position_embeddings=64, use_cache=False)


class HandWrittenNormsLM(nn.Module):
    """Pre-norm blocks with an RMSNorm by hand (x * rsqrt(mean(x^2) + eps) * w) and a final LayerNorm by hand.
    Embeddings start at std 0.02 as GPT's and Llama's do: rsqrt of their mean square is ~50, its cube past fp16."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.norm_weight = nn.Parameter(torch.ones(width))
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.final_weight, self.final_bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        h = h + self.ff(normed)
        centred = h - h.mean(-1, keepdim=True)
        h = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * self.final_weight + self.final_bias
        return self.head(h)


def _token_logits_cross_entropy(out, label):
    return F.cross_entropy(out.flatten(0, 1), label.flatten())


# issue 29, capture front end: a causal LM called without logits_to_keep (an int default HF's slicing reads;
# traced as a graph input, the logits lost their sequence dim), and an encoder/decoder split where neither child
# traces (an attribute of the encoder's output feeds the decoder: a deleted getattr node; six failing exports).
class KeepLogitsCausalLM(nn.Module):
    """Embedding -> causal self-attention -> MLP -> LM head; `logits_to_keep` sliced as HF's *ForCausalLM do."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask=None, logits_to_keep: int = 0):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)   # 3 x (batch, heads, length, dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        h = self.norm(h + self.out(attended))
        h = h + self.mlp(h)
        positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.head(h[:, positions, :]))


@dataclass
class _FeatureMaps:
    feature_maps: torch.Tensor
    pooled: torch.Tensor


class _GuardedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.pool = nn.Linear(16, 16)

    def forward(self, x):
        h = self.blocks(F.relu(self.stem(x)))
        if h.abs().max() > 1e4:   # data-dependent Python (a guard against fp16 overflow): no front end traces it
            h = h / h.abs().max()
        return _FeatureMaps(feature_maps=h, pooled=self.pool(h.mean((2, 3))))


class _GuardedDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 3, padding=1)
        self.classify = nn.Conv2d(8, 4, 1)

    def forward(self, maps):
        y = F.relu(self.conv(maps))
        if not torch.isfinite(y).all():
            y = torch.nan_to_num(y)
        return self.classify(y)


class UntraceableEncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = _GuardedEncoder(), _GuardedDecoder()

    def forward(self, x):
        return self.decoder(self.encoder(x).feature_maps)


# ---------------------------------------------------------------------------------------- training data
def _class_label(classes: int) -> Callable[[int], torch.Tensor]:
    return lambda size: torch.randint(classes, (size,), generator=_generator(size, salt=7))


def _token_label(size: int) -> torch.Tensor:
    return _tokens(size, salt=7, low=0)


def _cross_entropy(out, label):
    return F.cross_entropy(out, label)


def _logits_cross_entropy(out, label):
    return F.cross_entropy(out.logits, label)


def _lm_cross_entropy(out, label):
    return F.cross_entropy(out.logits.flatten(0, 1), label.flatten())


def _nll(out, label):
    return F.nll_loss(out, label)


# ------------------------------------------------------------------------------------------- registry
_ALL = [
    # transformers
    RealModel("hf_bert_eager", "transformers", lambda: _bert("eager"), text_inputs, last_hidden_state),
    RealModel("hf_bert_sdpa", "transformers", lambda: _bert("sdpa"), text_inputs, last_hidden_state),
    RealModel("hf_bert_classifier", "transformers", _bert_classifier, text_inputs, logits,
              loss_fn=_logits_cross_entropy, make_label=_class_label(3)),
    RealModel("hf_gpt2_eager", "transformers", lambda: _gpt2("eager"), gpt2_inputs, logits,
              loss_fn=_lm_cross_entropy, make_label=_token_label),
    RealModel("hf_gpt2_sdpa", "transformers", lambda: _gpt2("sdpa"), gpt2_inputs, logits),
    RealModel("hf_llama", "transformers", _llama, text_inputs, logits),
    RealModel("hf_t5", "transformers", _t5, seq2seq_inputs, logits),
    RealModel("hf_bart", "transformers", _bart, seq2seq_inputs, last_hidden_state),
    RealModel("hf_distilbert", "transformers", _distilbert, text_inputs, last_hidden_state),
    RealModel("hf_vit", "transformers", _vit_hf, image_inputs, logits),
    RealModel("hf_whisper", "transformers", _whisper, whisper_inputs, last_hidden_state),
    RealModel("hf_clip", "transformers", _clip, clip_inputs, logits_per_image),
    RealModel("hf_whisper_args_wrapper", "transformers", lambda: ArgsWrapper(_whisper()), whisper_inputs,
              last_hidden_state),
    RealModel("hf_wav2vec2", "transformers", _wav2vec2, audio_inputs, logits),
    RealModel("hf_deberta_v2", "transformers", _deberta_v2, text_inputs, last_hidden_state),
    RealModel("hf_deberta_v3", "transformers", _deberta_v3, text_inputs, last_hidden_state),
    RealModel("hf_mixtral", "transformers", _mixtral, text_inputs, logits),
    RealModel("hf_qwen2_moe", "transformers", _qwen2_moe, text_inputs, logits),
    # torchvision
    RealModel("tv_resnet18", "torchvision", _resnet, image_inputs, tensor, sizes=(4, 3),
              loss_fn=_cross_entropy, make_label=_class_label(10)),
    RealModel("tv_mobilenet_v3", "torchvision", _mobilenet_v3, _image_64, tensor),
    RealModel("tv_efficientnet_b0", "torchvision", _efficientnet, _image_64, tensor),
    RealModel("tv_convnext", "torchvision", _convnext, image_inputs, tensor),
    RealModel("tv_vit", "torchvision", _vit_tv, image_inputs, tensor),
    RealModel("tv_swin", "torchvision", _swin, image_inputs, tensor),
    RealModel("tv_deeplabv3", "torchvision", _deeplab, _image_64, segmentation_map),
    RealModel("tv_ssdlite", "torchvision", _ssdlite, detection_inputs, detection_scores),
    RealModel("tv_raft_small", "torchvision", _raft_small, lambda s: _image_pair(s, 128, 128), last_flow),
    RealModel("tv_raft_small_2_levels", "torchvision", _raft_small_two_levels, lambda s: _image_pair(s, 64, 96),
              last_flow),
    # timm
    RealModel("timm_deit", "timm", _timm("deit_tiny_patch16_224", img_size=IMAGE, patch_size=8, depth=2),
              image_inputs, tensor),
    RealModel("timm_regnet", "timm", _timm("regnetx_002"), image_inputs, tensor),
    RealModel("timm_convnext", "timm", _timm("convnext_atto"), image_inputs, tensor),
    RealModel("timm_mobilenetv3", "timm", _timm("mobilenetv3_small_050"), _image_64, tensor, sizes=(4, 3),
              loss_fn=_cross_entropy, make_label=_class_label(10)),
    # PyTorch Geometric (size = number of nodes)
    RealModel("pyg_gcn", "pyg", GCN, graph_inputs, tensor, sizes=(140, 97),
              loss_fn=_nll, make_label=_class_label(PYG_CLASSES)),
    RealModel("pyg_gat", "pyg", GAT, graph_inputs, tensor, sizes=(140, 97)),
    # diffusers
    RealModel("diffusers_unet2d_condition", "diffusers", _unet_conditional, unet_conditional_inputs, denoised_sample),
    RealModel("diffusers_unet2d", "diffusers", _unet_unconditional, unet_unconditional_inputs, denoised_sample),
    # torch.nn
    RealModel("nn_lstm", "torch.nn", LSTMClassifier, sequence_inputs, first),
    RealModel("nn_gru", "torch.nn", GRUTagger, sequence_inputs, tensor),
    RealModel("nn_transformer_encoder", "torch.nn", TokenTransformerEncoder, lambda s: (_tokens(s),), tensor),
    RealModel("nn_multihead_attention", "torch.nn", SelfAttentionBlock, attention_inputs, tensor),
    RealModel("nn_moe_index_add", "torch.nn", IndexAddMoE, sequence_inputs, tensor),
    RealModel("nn_finfo_masked_attention", "torch.nn", FinfoMaskedAttention, text_inputs, tensor),
    # issue 29, numerics of the decisions (the model's upcasts, hand-written norms, trained at O2)
    RealModel("hf_gemma", "transformers", _gemma, text_inputs, logits, loss_fn=_lm_cross_entropy,
              make_label=_token_label),
    RealModel("nn_hand_written_norms", "torch.nn", HandWrittenNormsLM, lambda s: (_tokens(s),), tensor,
              loss_fn=_token_logits_cross_entropy, make_label=_token_label),
    # issue 29, training paths (token BatchNorm over a transposed tensor, trained at O2)
    RealModel("nn_time_series_token_batchnorm", "torch.nn", TimeSeriesTokenBatchNorm, series_inputs, tensor,
              loss_fn=_cross_entropy, make_label=_class_label(4)),
    RealModel("pyg_pooled_gcn", "pyg", PooledGCN, pooled_graph_inputs, tensor, sizes=(40, 29),
              loss_fn=_cross_entropy, make_label=_graph_label),
    # issue 29, capture front end (an int default kept out of the graph's inputs; children that do not trace)
    RealModel("nn_causal_lm_logits_to_keep", "torch.nn", KeepLogitsCausalLM, lambda s: (_tokens(s),), logits),
    RealModel("nn_untraceable_encoder_decoder", "torch.nn", UntraceableEncoderDecoder, image_inputs, tensor),
]
REAL_MODELS: dict[str, RealModel] = {spec.name: spec for spec in _ALL}
REAL_MODEL_NAMES = tuple(REAL_MODELS)
TRAIN_NAMES = tuple(name for name, spec in REAL_MODELS.items() if spec.loss_fn is not None)
ONNX_NAMES = ("tv_resnet18", "tv_mobilenet_v3", "hf_bert_sdpa", "hf_gpt2_eager", "hf_vit", "diffusers_unet2d_condition")

__all__ = ["RealModel", "REAL_MODELS", "REAL_MODEL_NAMES", "TRAIN_NAMES", "ONNX_NAMES", "torchvision"]
