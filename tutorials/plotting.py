"""Plot helpers shared by the tutorials (display only: nothing here is part of the algorithm)."""

import matplotlib.pyplot as plt
import numpy as np


def token_label(tokenizer, token_id: int, eos_ids) -> str:
    """A token as readable text: '<end>' for an end token, else the decoded string, or its vocabulary entry
    when that is not printable."""
    if token_id in eos_ids:
        return "<end>"
    text = tokenizer.decode([token_id])
    return text if text.isprintable() and text.strip() else tokenizer.convert_ids_to_tokens(token_id)


def token_grid(ax, tokenizer, eos_ids, ids, mask, values, title, cmap, vmin, vmax, label):
    """Heatmap of per-token values, each cell labelled with its token; masked cells grey.

    ids, mask, values: (N, R) tensors (response token ids, 1 = real token, one value per token).
    """
    shown = np.ma.masked_where(mask.numpy() == 0, values.numpy())
    colormap = plt.get_cmap(cmap).copy()
    colormap.set_bad("#e6e6e6")
    im = ax.imshow(shown, cmap=colormap, vmin=vmin, vmax=vmax, aspect="auto")
    for (i, t), token_id in np.ndenumerate(ids.numpy()):
        if mask[i, t]:
            r, g, b, _ = im.cmap(im.norm(shown[i, t]))
            ax.text(
                t,
                i,
                token_label(tokenizer, int(token_id), eos_ids),
                ha="center",
                va="center",
                fontsize=8,
                color="black" if 0.3 * r + 0.6 * g + 0.1 * b > 0.5 else "white",
            )  # dark text on light cells
    ax.set_xlabel("response position")
    ax.set_ylabel("sample (prompt x G)")
    ax.set_title(title)
    plt.colorbar(im, ax=ax, label=label, extend="both")  # colors saturate beyond [vmin, vmax]
