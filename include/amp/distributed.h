// amp/distributed.h: everything for more than one process (opt-in: needs
// c10d and Gloo's headers, which amp/amp.h does not pull in).
//
//   #include <amp/distributed.h>
//   amp::ProcessGroup pg = amp::init_process_group();   // torchrun's environment
//   amp::DataParallel dp(pg, trainer);
//   amp::FullyShard fsdp(pg, *model, units);      // or: parameters, gradients, states sharded
//   amp::save_fully_sharded(trainer, "ckpt.pt");   // its checkpoints (every rank calls it)
#pragma once

#include "amp/distributed/data_parallel.h"
#include "amp/distributed/fully_shard.h"
#include "amp/distributed/fully_shard_checkpoint.h"
#include "amp/distributed/process_group.h"
#include "amp/distributed/sharded_optimizer.h"
