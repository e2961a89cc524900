"""The papers gradsync implements or compares with, by the short names its docstrings cite
("mg-wfbp eq. 20", "us-byte Algorithm 1", "acp-sgd §IV-B", "forest-packing problem (8)").

=================  ===========================================================================
short name         paper
=================  ===========================================================================
mg-wfbp            Shi, Chu, Li. MG-WFBP: Efficient Data Communication for Distributed
                   Synchronous SGD Algorithms. IEEE INFOCOM 2019.
asc-wfbp           Shi, Chu, Li. Exploiting Simultaneous Communications to Accelerate Data
                   Parallel Distributed Deep Learning. IEEE INFOCOM 2021.
us-byte            Gao, Hu, Boloursaz Mashhadi, Jin, Xiao, Wu. US-Byte: An Efficient
                   Communication Framework for Scheduling Unequal-Sized Tensor Blocks in
                   Distributed Deep Learning. IEEE TPDS 2024.
acp-sgd            L. Zhang, L. Zhang, Shi, Chu, Li. Evaluation and Optimization of Gradient
                   Compression for Distributed Deep Learning. IEEE ICDCS 2023.
forest-packing     Z. Zhang, Wu, Li. Near-Optimal Topology-adaptive Parameter Synchronization in
                   Distributed DNN Training. IEEE INFOCOM 2021.
ByteScheduler      Peng et al. A Generic Communication Scheduler for Distributed DNN Training
                   Acceleration. ACM SOSP 2019.
torch DDP          Li et al. PyTorch Distributed: Experiences on Accelerating Data Parallel
                   Training. VLDB 2020.
Power-SGD          Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient Compression
                   for Distributed Optimization. NeurIPS 2019.
EF-SignSGD         Karimireddy, Rebjock, Stich, Jaggi. Error Feedback Fixes SignSGD and other
                   Gradient Compression Schemes. ICML 2019.
Top-k SGD          Stich, Cordonnier, Jaggi. Sparsified SGD with Memory. NeurIPS 2018.
Bagua              Gan et al. BAGUA: Scaling up Distributed Learning with System Relaxations.
                   VLDB 2022 (its ByteGrad: 8-bit min-max quantisation).
=================  ===========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paper:
    title: str
    authors: str
    venue: str
    link: str


PAPERS = {
    "mg-wfbp": Paper("MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD Algorithms",
                     "Shaohuai Shi, Xiaowen Chu, Bo Li", "IEEE INFOCOM 2019",
                     "https://doi.org/10.1109/INFOCOM.2019.8737367"),
    "asc-wfbp": Paper("Exploiting Simultaneous Communications to Accelerate Data Parallel Distributed Deep Learning",
                      "Shaohuai Shi, Xiaowen Chu, Bo Li", "IEEE INFOCOM 2021",
                      "https://doi.org/10.1109/INFOCOM42981.2021.9488803"),
    "us-byte": Paper("US-Byte: An Efficient Communication Framework for Scheduling Unequal-Sized Tensor Blocks in "
                     "Distributed Deep Learning",
                     "Yunqi Gao, Bing Hu, Mahdi Boloursaz Mashhadi, A-Long Jin, Pei Xiao, Chunming Wu",
                     "IEEE Transactions on Parallel and Distributed Systems, 2024",
                     "https://doi.org/10.1109/TPDS.2023.3331372"),
    "acp-sgd": Paper("Evaluation and Optimization of Gradient Compression for Distributed Deep Learning",
                     "Lin Zhang, Longteng Zhang, Shaohuai Shi, Xiaowen Chu, Bo Li", "IEEE ICDCS 2023",
                     "https://arxiv.org/abs/2306.08881"),
    "forest-packing": Paper("Near-Optimal Topology-adaptive Parameter Synchronization in Distributed DNN Training",
                            "Zhe Zhang, Chuan Wu, Zongpeng Li", "IEEE INFOCOM 2021",
                            "https://doi.org/10.1109/INFOCOM42981.2021.9488678"),
    "ByteScheduler": Paper("A Generic Communication Scheduler for Distributed DNN Training Acceleration",
                           "Yanghua Peng, Yibo Zhu, Yangrui Chen, Yixin Bao, Bairen Yi, Chang Lan, Chuan Wu, "
                           "Chuanxiong Guo", "ACM SOSP 2019", "https://doi.org/10.1145/3341301.3359642"),
    "torch DDP": Paper("PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
                       "Shen Li et al.", "VLDB 2020", "https://arxiv.org/abs/2006.15704"),
    "Power-SGD": Paper("PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
                       "Thijs Vogels, Sai Praneeth Karimireddy, Martin Jaggi", "NeurIPS 2019",
                       "https://arxiv.org/abs/1905.13727"),
    "EF-SignSGD": Paper("Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
                        "Sai Praneeth Karimireddy, Quentin Rebjock, Sebastian Stich, Martin Jaggi", "ICML 2019",
                        "https://arxiv.org/abs/1901.09847"),
    "Top-k SGD": Paper("Sparsified SGD with Memory", "Sebastian U. Stich, Jean-Baptiste Cordonnier, Martin Jaggi",
                       "NeurIPS 2018", "https://arxiv.org/abs/1809.07599"),
    "Bagua": Paper("BAGUA: Scaling up Distributed Learning with System Relaxations", "Shaoduo Gan et al.",
                   "VLDB 2022", "https://arxiv.org/abs/2107.01499"),
}


def cited(source: str) -> str | None:
    """The short name a citation such as "us-byte Algorithms 1–2" starts with (None if none)."""
    return next((name for name in sorted(PAPERS, key=len, reverse=True)
                 if source == name or source.startswith(name + " ")), None)


def link(source: str) -> str:
    """`source` as a markdown link to its paper ("—" when empty)."""
    if not source:
        return "—"
    name = cited(source)
    return f"[{source}]({PAPERS[name].link})" if name else source
