"""Deprecated name of ``search_demo.widen_heads`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.widen_heads", __name__ == "__main__")
