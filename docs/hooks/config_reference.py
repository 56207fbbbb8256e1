"""MkDocs hook that writes the configuration reference (a placeholder until the generator lands)."""


def on_page_markdown(markdown, **kwargs):
    return markdown
