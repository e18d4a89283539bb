"""EAGLE-3 drafts: the model, its draft vocabulary, and exports to vLLM/SGLang formats."""
from actwave.eagle3.config import Eagle3Config
from actwave.eagle3.export import (export_specforge, export_speculators, load_specforge,
                                   load_speculators)
from actwave.eagle3.model import Eagle3Draft, Eagle3Output
from actwave.eagle3.vocab import build_draft_vocab, coverage, token_frequencies

__all__ = ["Eagle3Config", "Eagle3Draft", "Eagle3Output", "build_draft_vocab", "coverage",
           "export_specforge", "export_speculators", "load_specforge", "load_speculators",
           "token_frequencies"]
