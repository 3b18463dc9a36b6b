"""Course support: notebook set-up, the opening notebooks' toys, plotting, and the exercise scorecard."""
