"""The word-level tokenizer that random test models use.

A setting's random models (`:smoke` configs, tests) need a tokenizer that
ships with no files: this one builds a Hugging Face fast tokenizer from a
list of pieces, with a small chat template. Character level by default;
settings add the words of their prompts so prompts stay short.
"""

from __future__ import annotations

from collections.abc import Sequence

ALPHABET = ('abcdefghijklmnopqrstuvwxyz' 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'
            "0123456789 .,:;!?-+/=(){}[]\\_'\n")
SPECIALS = ('<pad>', '<s>', '</s>', '<unk>', '<|system|>', '<|user|>',
            '<|assistant|>')
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
    '{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}')


def make_tokenizer(tokens: Sequence[str] = tuple(ALPHABET),
                   split: str = r'.|\n', specials: Sequence[str] = ()):
  """A word-level tokenizer for random models, with a chat template.

  One id per SPECIALS entry and per extra special token of `specials` (a
  vision model's image tokens), then one per distinct entry of `tokens`
  (ALPHABET: character level); text is split into pieces by the regex
  `split`, and a piece not in `tokens` is <unk>.
  """
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  vocab = {t: i for i, t in enumerate(
      dict.fromkeys(SPECIALS + tuple(specials) + tuple(tokens)))}
  tok = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(split), behavior='isolated')
  tok.decoder = tokenizers.decoders.Fuse()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token='<pad>', bos_token='<s>',
      eos_token='</s>', unk_token='<unk>',
      additional_special_tokens=list(SPECIALS[4:]) + list(specials))
  fast.chat_template = CHAT_TEMPLATE
  return fast
