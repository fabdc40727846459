// Each line's name at its last drawn point, in the right margin, pushed apart so that
// lines ending close together (eight users at 94-98 %) keep readable labels.

import { lastIndex } from "./buckets.js";

// CSS px from the plot's right edge to the end labels (the leaders run between).
const LABEL_GAP = 14;
// CSS px between two labels' middles; the labels' font size.
const LINE_PX = 13;
const FONT_PX = 11;

// The right padding the plot leaves for the labels: their gap, about 6.5 px a character
// at 11 px and 10 px to spare; at most a third of the width.
export function labelRoom(width, labels) {
  const longest = Math.max(0, ...labels.map((l) => l.text.length));
  return Math.min(Math.round(width / 3), LABEL_GAP + 10 + Math.ceil(6.5 * longest));
}

// Where each label goes (canvas px), from top to bottom: at its line's end (`at`), moved
// down then up just enough to keep `gap` between labels and stay within top..bottom.
function spread(labels, top, bottom, gap) {
  for (let i = 0; i < labels.length; i++)
    labels[i].y = Math.max(labels[i].y, i ? labels[i - 1].y + gap : top);
  for (let i = labels.length - 1; i >= 0; i--)
    labels[i].y = Math.min(labels[i].y, i < labels.length - 1 ? labels[i + 1].y - gap : bottom);
  return labels;
}

// The labels of the lines with a drawn point, by the height of their last one.
function lineEnds(u, labels) {
  return labels
    .map(({ series, text, colour }) => {
      const values = u.data[series];
      const i = lastIndex(values);
      if (i < 0) return null;
      const y = u.valToPos(values[i], "y", true);
      return { y, at: y, text, colour };
    })
    .filter(Boolean)
    .sort((a, b) => a.y - b.y);
}

// A leader from the line's end to its label, where the label was pushed away: grey,
// dotted and outside the plot, so it never reads as the line's last step (a coloured
// slope there looked like the current minute dipping).
function drawLeader(ctx, px, edge, x, { y, at }) {
  ctx.strokeStyle = "#9aa0a6";
  ctx.setLineDash([2 * px, 2 * px]);
  ctx.beginPath();
  ctx.moveTo(edge + 2 * px, at);
  ctx.lineTo(x - 2 * px, y);
  ctx.stroke();
  ctx.setLineDash([]);
}

// getLabels: () => [{series: its index in the plot's data, text, colour}], read at each draw.
export function endLabelPlugin(getLabels) {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          const px = devicePixelRatio;
          const gap = LINE_PX * px;
          const top = u.bbox.top + gap / 2;
          const bottom = u.bbox.top + u.bbox.height;
          const labels = spread(lineEnds(u, getLabels()), top, bottom, gap);
          ctx.save();
          ctx.font = `${FONT_PX * px}px system-ui, sans-serif`;
          ctx.textBaseline = "middle";
          ctx.textAlign = "left";
          const edge = u.bbox.left + u.bbox.width;
          const x = edge + LABEL_GAP * px;
          ctx.lineWidth = px;
          for (const label of labels) {
            if (Math.abs(label.y - label.at) >= px) drawLeader(ctx, px, edge, x, label);
            ctx.fillStyle = label.colour;
            ctx.fillText(label.text, x, label.y);
          }
          ctx.restore();
        },
      ],
    },
  };
}
