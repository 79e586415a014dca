"""The source bank in one place: its modules and math (`source`), decoding's per-vocabulary tables (`tables`) and a
decode state's cache of it (`cache`)."""

from prisme.model.bank.cache import BankCache
from prisme.model.bank.source import SourceBank
from prisme.model.bank.tables import bank_tables, clear_bank_tables, decoded_query, entries_from_ids, step_entries

__all__ = ["BankCache", "SourceBank", "bank_tables", "clear_bank_tables", "decoded_query", "entries_from_ids",
           "step_entries"]
