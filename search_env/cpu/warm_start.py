"""Deprecated name of ``search_demo.warm_start`` (see ``search_env.moved``)."""

from search_env.moved import forward

forward(__spec__.name, "search_demo.warm_start", __name__ == "__main__")
