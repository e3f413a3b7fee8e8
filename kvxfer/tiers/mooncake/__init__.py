"""The Mooncake Store tier: a cache group's blocks in a Mooncake Store cluster (``store``), its bounded client
(``client``), the audit that announces what the store evicted (``audit``) and its config section (``settings``)."""
