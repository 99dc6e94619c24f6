"""snapspec.runtime: exported folder -> ONNX Runtime sessions, contexts with bounded rollback, generation.

    from snapspec.runtime import load, generate
    target, drafter = load("out/target"), load("out/drafter")
    gen = generate(target, "def fib(n):", drafter=drafter, max_new_tokens=64, draft_max=4)
    print(target.decode(gen.tokens), gen.stats.acceptance)

    chat = ChatSession(target, drafter)                     # the export's chat template; state kept across turns
    print("".join(chat.reply("Write a haiku.")))
    gen = generate(target, [{"role": "user", "content": "Hi"}])   # messages: rendered with the chat template
"""

from .chat import ChatSession, PromptCache, chat
from .context import PREFILL_CHUNK, Context, RollbackError, Rows
from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from .generation import Generator, final_text, generate, stream_text
from .model import Model, load
from .pair import Pair, make_drafter
from .policy import ROLLBACK, Policy, store_for
from .providers import PROVIDERS
from .sampling import SamplingParams
from .stats import Stats

__all__ = ["ChatSession", "PromptCache", "chat", "Context", "Draft", "Drafter", "Generator", "Model", "ModelDrafter",
           "NgramDrafter", "PREFILL_CHUNK", "PROVIDERS", "Pair", "Policy", "ROLLBACK", "RollbackError", "Rows",
           "SamplingParams", "Stats", "final_text", "generate", "load", "make_drafter", "store_for", "stream_text"]

# Names that were replaced: importing one says what to use instead (a one-line error, not a bare "cannot import").
_REPLACED = {"open_context": "Policy(model).open(model, length, side)", "stores_for": "store_for(model, side)"}


def __getattr__(name: str):
    if name in _REPLACED:
        raise ImportError(f"snapspec.runtime.{name} was replaced by the rollback policy: use {_REPLACED[name]}")
    raise AttributeError(f"module 'snapspec.runtime' has no attribute {name!r}")
