"""The source bank in one place: its modules and math (`source`), decoding's per-vocabulary tables (`tables`), how
the editor reads it (`read`: one interface, entries or ids behind it), a decode state's cache of it (`cache`) and
its exact suffix matches (`suffix`: the copy head's keys)."""

from prisme.model.bank.cache import BankCache
from prisme.model.bank.read import BankRead, EntryRead, IdRead, PackedRead, RowRead, read_rows
from prisme.model.bank.source import SourceBank
from prisme.model.bank.tables import bank_tables, clear_bank_tables, decoded_query, entries_from_ids, step_entries

__all__ = ["BankCache", "BankRead", "EntryRead", "IdRead", "PackedRead", "RowRead", "SourceBank", "bank_tables",
           "clear_bank_tables", "decoded_query", "entries_from_ids", "read_rows", "step_entries"]
