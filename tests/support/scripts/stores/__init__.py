"""Jobs that use a store (an S3 server on 127.0.0.1) while it stops answering: ``stalled_store.py``."""
