"""From-scratch BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa) over a flat batch of whole
prompts, with Hugging Face's parameter names so their checkpoints load directly.

forward(input_ids [T], lengths, token_type_ids [T] | None) -> final hidden states [T, H]: the
prompts of a step back to back, each `lengths[i]` tokens, attending to every token of its own
prompt (no causal mask, no KV cache). `classify(rows [n, H])` -> logits [n, labels] is a
*ForSequenceClassification's head over [CLS] rows, or a *ForTokenClassification's over any rows. Post-norm layers as in HF: attention,
residual, LayerNorm; feed-forward, residual, LayerNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig

ACT_FNS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        enc = cfg.encoder
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(enc.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=enc.layer_norm_eps)
        self.offset = enc.position_offset

    def forward(self, input_ids, positions, token_type_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)


class DenseNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: LayerNorm(dense(x) + residual)."""

    def __init__(self, d_in: int, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg)
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim

    def forward(self, x, batch: "LengthGroups"):
        s = self.self
        q, k, v = s.query(x), s.key(x), s.value(x)
        if len(batch.groups) == 1:
            g = batch.groups[0]
            o = g.unpad(F.scaled_dot_product_attention(*(g.pad(y, self.heads, self.head_dim) for y in (q, k, v)),
                                                       attn_mask=g.mask))
        else:
            o = torch.empty_like(q)
            for g in batch.groups:
                o[g.rows] = g.unpad(F.scaled_dot_product_attention(
                    *(g.pad(y, self.heads, self.head_dim) for y in (q, k, v)), attn_mask=g.mask))
        return self.output(o, x)


class Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACT_FNS[cfg.encoder.hidden_act]

    def forward(self, x):
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg)

    def forward(self, x, batch):
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))


class Pooler(nn.Module):
    """BERT's pooler: tanh(dense([CLS] row)), read by BertForSequenceClassification's classifier."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class RobertaHead(nn.Module):
    """RobertaClassificationHead: out_proj(tanh(dense([CLS] row)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, len(cfg.labels))


class PaddedGroup:
    """Prompts of similar length as one padded [B, heads, Lmax, D] attention call: the flat rows
    they own (`rows`), where each goes in the padded batch (`index`), and the mask that keeps
    padding out of every softmax (keys only). A lone prompt needs neither padding nor mask."""

    def __init__(self, starts: list[int], lengths: list[int], device):
        self.b, self.lmax = len(lengths), max(lengths)
        if self.b == 1:
            self.rows = slice(starts[0], starts[0] + lengths[0])
            self.index = self.mask = None
            return
        pos = torch.arange(self.lmax, device=device)
        lens = torch.tensor(lengths, device=device)
        valid = pos[None, :] < lens[:, None]                                # [B, Lmax]
        self.index = (torch.arange(self.b, device=device)[:, None] * self.lmax + pos[None, :])[valid]
        self.rows = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths)])
        self.mask = valid[:, None, None, :]

    def pad(self, y, heads: int, d: int):
        y = y[self.rows]
        if self.index is None:
            return y.view(1, -1, heads, d).transpose(1, 2)
        out = y.new_zeros(self.b * self.lmax, heads * d)
        out[self.index] = y
        return out.view(self.b, self.lmax, heads, d).transpose(1, 2)

    def unpad(self, o):
        o = o.transpose(1, 2).reshape(self.b * self.lmax, -1)
        return o if self.index is None else o[self.index]


class LengthGroups:
    """A step's prompts grouped for attention: sorted by length, a group closes when the next
    prompt is over twice its shortest, so padding stays under 2x the attention a group needs
    (one 512-token prompt among short ones would otherwise pad them all to 512)."""

    def __init__(self, lengths: list[int], device):
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        members: list[list[int]] = [[]]
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            if members[-1] and lengths[i] > 2 * lengths[members[-1][0]]:
                members.append([])
            members[-1].append(i)
        if len(members) == 1:       # in step order: the group's rows are the step's, as they come
            members = [list(range(len(lengths)))]
        self.groups = [PaddedGroup([starts[j] for j in m], [lengths[j] for j in m], device) for m in members]


class BertEncoderModel(nn.Module):
    """The encoder and, for a classifier, its head. Parameter names are HF's base model's
    (`embeddings.*`, `encoder.layer.N.*`, `pooler.*`) and its classifier's (`classifier.*`); the
    loader strips the `bert.` / `roberta.` prefix a *For* class stores them under."""

    def __init__(self, config: ModelConfig, backend=None):
        super().__init__()
        self.config = config
        head = config.encoder.head
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if head == "bert" else None
        if head in ("bert", "token"):
            self.classifier = nn.Linear(config.hidden_size, len(config.labels))
        elif head == "roberta":
            self.classifier = RobertaHead(config)
        else:
            self.classifier = None
        self.projector = None           # sentence-transformers Dense modules, set by the loader
        self.backend = None             # attention is this module's own: no backend, no KV

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (0, num_blocks, 2, block_size, c.num_attention_heads, c.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        dev = input_ids.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions, token_type_ids)
        batch = LengthGroups(lengths, dev)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    @torch.inference_mode()
    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [n, labels] from final hidden rows [n, H] ([CLS] rows for a
        sequence classifier; any token's for a token classifier)."""
        if self.classifier is None:
            raise RuntimeError("this encoder has no classification head")
        if self.config.encoder.head == "token":
            return self.classifier(cls_rows)
        if self.pooler is not None:
            return self.classifier(torch.tanh(self.pooler.dense(cls_rows)))
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_rows)))
