"""Job scripts of the tests, one folder per topic (each also importable as ``support.scripts.<topic>``)."""
