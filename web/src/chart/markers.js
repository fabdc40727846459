// Limit changes drawn on the plot: a dashed vertical line at each, in the user's colour.

// getMarks: () => [{x: the bucket's time, colour}], read at each draw.
export function markerPlugin(getMarks) {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          ctx.save();
          ctx.setLineDash([4, 4]);
          ctx.lineWidth = 1.5 * devicePixelRatio;
          for (const { x, colour } of getMarks()) {
            const px = u.valToPos(x, "x", true);
            ctx.strokeStyle = colour;
            ctx.beginPath();
            ctx.moveTo(px, u.bbox.top);
            ctx.lineTo(px, u.bbox.top + u.bbox.height);
            ctx.stroke();
          }
          ctx.restore();
        },
      ],
    },
  };
}
