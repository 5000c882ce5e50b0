"""Training a converted model: the joint forward+backward graph, loss scaling, GradScaler."""
