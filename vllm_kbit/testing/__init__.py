"""Development and demo fixtures (tiny and real test models, ``make demo``), never imported by the runtime code."""
