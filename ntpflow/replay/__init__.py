"""The replay wing: a finished run replayed step by step with influence tracking (``attribute``) and the exact audit
of its balance (``balance``)."""
