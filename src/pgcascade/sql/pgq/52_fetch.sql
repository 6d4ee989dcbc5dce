-- The low-latency read of a batch: one call per batch for a consumer that keeps up.
--
-- A consumer that is caught up asks for "a tick now if committed events wait" as part of its
-- next-batch call, so a change waits for no ticker: ticks follow the consumers' pace -
-- immediate when changes trickle in, larger batches when the consumer is busy applying the
-- last one - and the ticker daemon is left with idle ticks and maintenance.  The same call
-- finishes the consumer's previous batch and, for a small batch, returns its events inline
-- (one round trip for the whole read).

-- pgcascade.commit_time(xid8) -> the transaction's commit time (track_commit_timestamp), or null:
-- what a two-way master compares versions by (next_batch_events' commit_times, the two-way apply).
-- Volatile, as pg_xact_commit_timestamp is: so the planner inlines it (a stable SQL function
-- whose body is volatile is called instead, 14 us an event of a peer's fetch).
create or replace function pgcascade.commit_time(i_xid xid8) returns timestamptz
language sql volatile as $$
    select pg_xact_commit_timestamp((i_xid::text::int8 % 4294967296)::text::xid)
$$;

-- pgcascade.events_committed_since(queue_id, snapshot) -> whether an event of the queue was
-- committed after `snapshot`: its transaction is visible now and was not in the snapshot.
-- A two-way master's marker (pgcascade.peer-seen, written with each peer batch it applies) does
-- not count: its peers need it only before the master's next change, which it precedes in the
-- queue.  Counted, it made a tick on demand for every batch applied, so two masters answered
-- each other's markers with a batch each (half of all batches at 200 tps a master).
-- A loose scan of the distinct transaction ids above the snapshot's xmax (one index probe
-- each), so a long transaction still writing millions of events costs one probe, not a scan
-- of its events; plus the snapshot's in-progress ids.
create or replace function pgcascade.events_committed_since(i_queue_id int4, i_snap pg_snapshot) returns bool
language plpgsql stable as $$
declare
    lo int4 := i_queue_id * 16;
    now_snap pg_snapshot := pg_current_snapshot();
    x int8 := pg_snapshot_xmax(i_snap)::text::int8 - 1;
    xmax_now int8 := pg_snapshot_xmax(now_snap)::text::int8;
    xid xid8;
begin
    -- (markers filtered in the probe: a master writes one in a transaction of its own with every
    -- peer batch it applies, and skipping them one probe and one check each took 0.13 ms a call
    -- at 200 tps a master)
    loop
        select min(ev_txid) into x from pgcascade.event
         where ev_part >= lo and ev_part < lo + 16 and ev_txid > x and ev_txid < xmax_now
           and ev_type <> 'pgcascade.peer-seen';
        exit when x is null;
        if pg_visible_in_snapshot(x::text::xid8, now_snap) then
            return true;
        end if;
    end loop;
    -- one index probe per transaction in progress at the snapshot: as one query, the planner
    -- took pg_snapshot_xip for 1,000 rows and joined it to a scan of the queue's events
    -- (4.6 ms a call at 300 tps, against the loop's probes)
    foreach xid in array array(select x8 from pg_snapshot_xip(i_snap) x8 where pg_visible_in_snapshot(x8, now_snap)) loop
        if exists (select 1 from pgcascade.event where ev_part >= lo and ev_part < lo + 16 and ev_txid = xid::text::int8
                                                   and ev_type <> 'pgcascade.peer-seen') then
            return true;
        end if;
    end loop;
    return false;
end $$;

-- (tick_if_waiting and other_readers, once called by next_batch_events, are inlined there)
drop function if exists pgcascade.tick_if_waiting(text);
drop function if exists pgcascade.tick_if_waiting(text, bool);
drop function if exists pgcascade.readers_behind(pgcascade.subscription);
drop function if exists pgcascade.other_readers(pgcascade.subscription);

-- pgcascade.next_batch_events(queue, consumer, finish_batch, max_events, max_tick, tick,
--                             inline_events, seqs, commit_times, listen_ms) -> the consumer's
--                             next batch:
--   the columns of next_batch_custom (batch_id null: nothing new), and
--   event_sql     the query of the batch's events, when they are not inline
--   events        the events as a JSON array (text) of [ev_id, ev_txid, ev_type, ev_data, ev_extra1,
--                 ev_time, ev_extra2, ev_extra3, ev_extra4], when the batch holds at most
--                 `inline_events` events (null otherwise)
--   row_counts    with inline events: {table: row events}
--   other_events  with inline events: how many are not row events (I/U/D)
--   seq_values    the values of the sequences named in `seqs`, read after the batch's later tick
--                 (null: no such one)
--   cur_tick_snapshot  the batch's later tick's snapshot, as text (a two-way master's marker
--                 says it; a tick this call made is not in its caller's statement snapshot)
--   pending       with `listen_ms` and no batch: the queue's doorbell was set for listen_ms
--                 and this says whether events may be pending all the same (consumer_listens,
--                 05_doorbell.sql): a caught-up consumer about to sleep on LISTEN rings in the
--                 call that found nothing, not in a round trip of its own after it (at 200 tps
--                 one consumer_listens call for every batch, 9 % of the provider's CPU of the path)
-- With `commit_times`, inline events carry their transaction's commit time (track_commit_timestamp)
-- instead of their insertion time: a two-way master compares versions by the origin's commit
-- time.  Events of more than inline_bytes (8 MB) in all are never inline (JSON text has a 1 GB
-- bound, and the worker holds the batch in memory).
-- First it finishes `finish_batch` if that is still open (the consumer applied it; finishing
-- twice is harmless), then, with `tick`, ticks the queue if the consumer is at its newest tick,
-- no other reader is far behind and committed events wait:
-- - committed events: not only numbered ones, for a long transaction writing events would
--   otherwise make an empty tick per call (events_committed_since).  Queues that take their
--   ticks from elsewhere (a branch's) or are paused are left alone; so is a queue another
--   session is ticking at this moment.
-- - other readers: another consumer that reads batches (active in the last 10 seconds; the
--   global watermark's registration reads none) more than 2 ticks behind this one makes ticks
--   on demand wait: one that takes one tick per batch - a cascade branch, which must repeat
--   every tick, or a PgQ consumer - would get more batches than it can apply while a faster one
--   asks for a tick every few milliseconds.  The ticker's ticks go on, so the slow one catches
--   up, and the ticks follow the pace of the slowest reader.
-- - a tick on demand is notified only where the queue has another consumer at all: the asker
--   reads it in the same call, and its NOTIFY - one for every batch of a consumer that keeps up
--   - held the cluster's notify lock through the commit's WAL flush and woke the asker's own
--   session (TPC-B flat out on the root, 3 alternated rounds each: 891 tps, 952 without it;
--   bench/path_cpu.py).  Every consumer that may sleep on LISTEN (another worker, a copy
--   process, a sink, a consumer of the API) is registered, and then every tick notifies.
-- These lookups are inline, not calls: the queue and the subscription (find_subscription's),
-- the newest tick (read once for both checks), the other readers and the committed events
-- were four PL/pgSQL functions and two lookups more - 1.77M -> 1.63M instructions of the
-- provider's backend a fetch with a tick (callgrind, two TPC-B transactions a batch).
-- next_batch_custom's batch, cut here: the finish, the tick and the new batch write the
-- subscription's row once, and a tick made here, next to the consumer's, is the batch's end
-- with no further lookup (2.35 -> 1.84 ms a call at 500 tps).
-- (the installs before it had neither commit_times nor cur_tick_snapshot, then no listen_ms)
drop function if exists pgcascade.next_batch_events(text, text, int8, int8, int8, bool, int8, text[]);
drop function if exists pgcascade.next_batch_events(text, text, int8, int8, int8, bool, int8, text[], bool);
create or replace function pgcascade.next_batch_events(
    i_queue_name text, i_consumer text, i_finish_batch int8, i_max_events int8, i_max_tick int8,
    i_tick bool, i_inline_events int8, i_seqs text[], i_commit_times bool, i_listen_ms int8 default null,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8,
    out event_sql text, out events text, out row_counts json, out other_events int8, out seq_values int8[],
    out cur_tick_snapshot text, out pending bool)
-- generic plans: a custom plan of the events query (pruned to the queue's partitions at plan
-- time) looks cheaper to the plan cache, which then plans it again at every call
language plpgsql set plan_cache_mode = force_generic_plan set enable_seqscan = off as $$
declare
    s pgcascade.subscription;
    q pgcascade.queue;
    last pgcascade.tick;  -- the queue's newest tick
    behind bool;  -- another reader is far behind
    others bool;  -- the queue has another consumer
    finished bool := false;  -- i_finish_batch finished in s, not written yet
    beyond bool := false;  -- ticks follow the consumer's position
    made int8;  -- the tick this call made
    v_next int8;
    prev_snap pg_snapshot;
    cur_snap txid_snapshot;
    xip int8[];
    n_events int8;
    n_bytes int8;
    inline_bytes constant int8 := 8388608;
begin
    -- the queue and the consumer's row (locked): find_subscription's lookups
    select * into q from pgcascade.queue where queue_name = i_queue_name;
    if not found then
        raise exception 'queue "%" does not exist', i_queue_name using errcode = 'P0002';
    end if;
    select sub.* into s from pgcascade.subscription sub join pgcascade.consumer c on c.co_id = sub.sub_consumer
     where sub.sub_queue = q.queue_id and c.co_name = i_consumer for update of sub;
    if not found then
        raise exception 'consumer "%" is not registered on queue "%"', i_consumer, i_queue_name
            using errcode = 'P0002';
    end if;
    -- any other batch to finish was finished already (batch ids are the consumer's own, and its
    -- row is locked): nothing to do.  (An UPDATE of the row whose sub_batch it was read the
    -- whole subscription table, which has no index on it: 21 ms a call with a few thousand dead
    -- row versions, for nothing.)
    if i_finish_batch is not null and s.sub_batch = i_finish_batch then
        s.sub_last_tick := s.sub_next_tick;
        s.sub_next_tick := null;
        s.sub_batch := null;
        s.sub_start_position := null;
        finished := true;
    end if;
    if s.sub_batch is null then
        -- the newest tick, by the primary key from its end: an EXISTS over tick_id > x was planned
        -- (generically, once the table had statistics) as a sequential scan that read every tick,
        -- and max() under a small table's statistics as an aggregate over every tick
        select * into last from pgcascade.tick t where t.tick_queue = s.sub_queue order by t.tick_id desc limit 1;
        beyond := coalesce(last.tick_id > s.sub_last_tick, false);
        if not beyond and i_tick and (i_max_tick is null or i_max_tick > s.sub_last_tick)
           and not q.queue_external_ticker and not q.queue_ticker_paused then
            select coalesce(bool_or(o.sub_active > now() - interval '10 seconds' and o.sub_last_tick < s.sub_last_tick - 2),
                            false),
                   count(*) > 0
              into behind, others
              from pgcascade.subscription o join pgcascade.consumer c on c.co_id = o.sub_consumer
             where o.sub_queue = s.sub_queue and o.sub_id <> s.sub_id and c.co_name <> '.global_watermark';
            -- committed events since the last tick: nothing numbered since it is not enough (a
            -- transaction in progress then had numbered its events before it, and commits them
            -- after), and numbered ones may not be committed yet.  First the one probe that
            -- answers under load: the queue's current partition's first event numbered by a
            -- transaction newer than the tick, committed (read from that partition alone, where
            -- events_committed_since's probes, called only when it finds none, read every one:
            -- 1.56M -> 1.49M instructions a fetch, bench/fetch_cpu.py --callgrind)
            if not behind
               and not (last.tick_id is not null
                        and ((coalesce(pg_sequence_last_value(q.queue_event_seq), 0) <= last.tick_event_seq
                              and not exists (select 1 from pg_snapshot_xip(last.tick_snapshot)))
                             or not (coalesce((select pg_visible_in_snapshot(min(ev.ev_txid)::text::xid8, pg_current_snapshot())
                                                 from pgcascade.event ev
                                                where ev.ev_part = q.queue_id * 16 + q.queue_cur_table
                                                  and ev.ev_txid >= pg_snapshot_xmax(last.tick_snapshot)::text::int8
                                                  and ev.ev_type <> 'pgcascade.peer-seen'), false)
                                     or pgcascade.events_committed_since(q.queue_id, last.tick_snapshot)))) then
                perform 1 from pgcascade.queue where queue_id = q.queue_id for update skip locked;
                if found then
                    made := pgcascade.make_tick(q, null, null, null, others, false);  -- (it inserts no event)
                end if;
            end if;
        end if;
    end if;
    -- read after any tick made above: a row committed before that tick's snapshot took its
    -- value before it, so the values read now cover every row of the batch.  Read before the
    -- tick, a transaction could take a value and commit in between: its row in the batch, the
    -- value not, and a node promoted after it handed that value out again
    if i_seqs is not null then
        seq_values := array(select pg_sequence_last_value(to_regclass(n)) from unnest(i_seqs) with ordinality u(n, o)
                             order by o);
    end if;
    -- (an open landing batch starts at the consumer's position: 53_position.sql)
    select t.tick_time, t.tick_event_seq, coalesce(s.sub_start_position::pg_snapshot, t.tick_snapshot)
      into prev_tick_time, prev_tick_event_seq, prev_snap
      from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = s.sub_last_tick;
    if not found then
        raise exception 'tick % of consumer "%" on queue "%" no longer exists', s.sub_last_tick, i_consumer, i_queue_name;
    end if;
    prev_tick_id := s.sub_last_tick;
    if s.sub_batch is null and (beyond or made is not null) and (i_max_tick is null or i_max_tick > s.sub_last_tick) then
        -- a tick made here right after the consumer's is the only one after it: ticks are
        -- numbered in turn under the queue's row lock, which this transaction holds
        v_next := case when made = s.sub_last_tick + 1 then made
                       else pgcascade.batch_end(s, prev_tick_event_seq, i_max_events, i_max_tick) end;
        if v_next is not null then
            s.sub_batch := nextval('pgcascade.batch_id_seq');
            s.sub_next_tick := v_next;
        end if;
    end if;
    if s.sub_batch is null then
        -- nothing new: no batch, and no write but the finish or a sign of life now and then
        -- (a consumer that keeps up asks every few milliseconds)
        if finished or s.sub_active < now() - interval '1 second' then
            update pgcascade.subscription
               set sub_last_tick = s.sub_last_tick, sub_next_tick = null, sub_batch = null,
                sub_start_position = s.sub_start_position, sub_active = now()
             where sub_id = s.sub_id;
        end if;
        if i_listen_ms is not null then
            pending := pgcascade.consumer_listens(i_queue_name, i_listen_ms, prev_tick_event_seq);
        end if;
        return;
    end if;
    if finished or v_next is not null then
        update pgcascade.subscription
           set sub_last_tick = s.sub_last_tick, sub_next_tick = s.sub_next_tick, sub_batch = s.sub_batch,
               sub_start_position = s.sub_start_position, sub_active = now()
         where sub_id = s.sub_id;
    end if;
    batch_id := s.sub_batch;
    cur_tick_id := s.sub_next_tick;
    select t.tick_time, t.tick_event_seq, t.tick_snapshot::text::txid_snapshot
      into cur_tick_time, cur_tick_event_seq, cur_snap
      from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = cur_tick_id;
    cur_tick_snapshot := cur_snap::text;
    if cur_tick_event_seq - prev_tick_event_seq > i_inline_events then
        event_sql := pgcascade.subscription_batch_sql(s);
        return;
    end if;
    -- the batch's events (batch_event_sql's selection) as static SQL: its plan is cached,
    -- where the composed query of a batch would be planned again each time
    -- (those still in progress at the later tick left out, as in batch_event_sql)
    xip := array(select x::text::int8 from pg_snapshot_xip(prev_snap) x
                  where txid_visible_in_snapshot(x::text::int8, cur_snap));
    -- at most one event more than inline: the ticks' event counters bound what was numbered
    -- between them, not what committed between them - a long transaction numbers its events
    -- before the earlier tick and commits them before the later one (one 5M-row UPDATE: a
    -- JSON text past 1 GB, and an error at every try)
    with e as materialized (
        select ev.ev_id, ev.ev_txid, ev.ev_type, ev.ev_data, ev.ev_extra1, ev.ev_rare,
               case when i_commit_times
                    then coalesce(pgcascade.commit_time(ev.ev_txid::text::xid8), ev.ev_time)
                    else ev.ev_time end as ev_time
          from pgcascade.event ev
         where ev.ev_part >= s.sub_queue * 16 and ev.ev_part < s.sub_queue * 16 + 16
           and (ev.ev_txid >= pg_snapshot_xmax(prev_snap)::text::int8 and ev.ev_txid < txid_snapshot_xmax(cur_snap)
                or ev.ev_txid = any(xip))
           and txid_visible_in_snapshot(ev.ev_txid, cur_snap)
           and (ev.ev_rare is null or (ev.ev_rare).ev_owner is null or (ev.ev_rare).ev_owner = s.sub_id)
         limit i_inline_events + 1),
    n as (select count(*) as c, coalesce(sum(octet_length(e.ev_data)), 0) as b from e)
    select n.c, n.b,
           case when n.c <= i_inline_events and n.b <= inline_bytes then  -- (not aggregated otherwise)
               (select json_agg(json_build_array(e.ev_id, e.ev_txid, e.ev_type, e.ev_data, e.ev_extra1, e.ev_time,
                                                 (e.ev_rare).ev_extra2, (e.ev_rare).ev_extra3, (e.ev_rare).ev_extra4)
                                order by e.ev_id)::text from e) end,
           (select json_object_agg(c.t, c.n) from (select e.ev_extra1 t, count(*) n from e
                                                    where e.ev_type in ('I', 'U', 'D') group by 1) c),
           (select count(*) from e where coalesce(e.ev_type, '') not in ('I', 'U', 'D'))
      from n
      into n_events, n_bytes, events, row_counts, other_events;
    if n_events > i_inline_events or n_bytes > inline_bytes then
        events := null;
        row_counts := null;
        other_events := null;
        event_sql := pgcascade.subscription_batch_sql(s);
        return;
    end if;
    events := coalesce(events, '[]');
    row_counts := coalesce(row_counts, '{}');
end $$;

-- pgcascade.tick_now(queue) -> the tick made, or null: a tick in the calling transaction, which
-- counts as committed in it (tick_snapshot) - the capture daemon's, right after it wrote a
-- commit group's events, so they wait for no ticker and its consumers are notified at commit.
-- Nothing happens on a queue that is paused or takes its ticks from elsewhere.
create or replace function pgcascade.tick_now(i_queue_name text) returns int8
language plpgsql set enable_seqscan = off as $$
declare
    q pgcascade.queue;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name for update;
    if not found or q.queue_external_ticker or q.queue_ticker_paused then
        return null;
    end if;
    return pgcascade.make_tick(q, null, null, null);
end $$;
