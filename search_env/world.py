"""Deprecated name of ``search_demo.world`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.world", __name__ == "__main__")
