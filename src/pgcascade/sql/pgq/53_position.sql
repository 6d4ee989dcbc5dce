-- Positions between ticks: the fetch of a leaf that keeps up, with no tick made for it.
--
-- A tick is a snapshot the provider persists.  A leaf that keeps up makes one for every batch
-- it fetches (next_batch_events' tick on demand): a row written, two rows locked and a commit
-- to flush on the provider, hundreds of times a second.  Here the leaf reads instead the
-- events of the transactions visible in a snapshot taken by its fetch's statement and not
-- visible at its position, and records that snapshot (its position) on its own side, in the
-- batch's transaction (apply_begin): nothing of it is kept on the provider, which only writes
-- the consumer's row when its WAL must be flushed first (below).  A position is
-- the newest tick the snapshot covers and the snapshot, so every reader of `last_tick` (lag,
-- watermarks, retention) sees a tick at or before it.
--
-- A position is only meaningful on the provider whose snapshot it is.  So only a consumer that
-- is its queue's only reader (the internal registrations aside) reads to positions: a set
-- where another node reads the queue - a branch a leaf could move to, another leaf, a peer -
-- keeps to ticks, and a position already held lands on the next tick first (a `landing`
-- batch from the position to the first tick that covers it).  So does a batch too large to
-- come inline, a table not ok, a cap (wanna-sync, delay): the caller asks to land.

-- pgcascade.snapshot_covers(later, earlier) -> whether every transaction visible in `earlier` is
-- visible in `later`: a tick whose snapshot was taken before a position and committed after it
-- does not cover it, and a batch from the position to that tick would take events twice.
create or replace function pgcascade.snapshot_covers(i_later pg_snapshot, i_earlier pg_snapshot) returns bool
language sql immutable as $$
    select pg_snapshot_xmax(i_later) >= pg_snapshot_xmax(i_earlier)
       and not exists (select 1 from pg_snapshot_xip(i_later) x
                        where x < pg_snapshot_xmax(i_earlier) and pg_visible_in_snapshot(x, i_earlier))
$$;

-- pgcascade.next_position_events(queue, consumer, finish_batch, tick, position, land,
--                                inline_events, seqs, listen_ms) -> the batch after the caller's
-- record (tick, and position: null at the tick itself), with next_batch_events' columns and
--   prev_position  the position the batch starts at (the caller's)
--   cur_position   the position it ends at: its snapshot, with cur_tick_id the newest tick that
--                  covers it; null when it ends at the tick cur_tick_id itself
--   alone          whether the consumer is the queue's only reader; false: the caller keeps to
--                  ticks (next_batch_events) for a while, after a landing if it is between two
--   by_ticks       the next batch is to be read by ticks: too many events wait for a position
--                  (a backlog), or the consumer is not alone
-- A batch to a position has batch_id 0: nothing is open on the provider, nothing to finish.
-- Without `land`, while the consumer is alone: the events committed since the position, read up
-- to the statement's snapshot, inline; none: an empty batch to the newest tick when that tick
-- covers the position (the record comes back to ticks while changes pause; what waits for a
-- tick - lag, `wait` - sees it), else no batch (with `listen_ms` the doorbell rung, as
-- next_batch_events does).  Events committed asynchronously are never applied before they are
-- flushed: when the WAL is not flushed past the snapshot's transactions (or synchronous
-- standbys are named), the call writes the consumer's row, and its commit flushes the WAL
-- (and waits for them); the caller commits its apply after that commit.  More
-- events than `inline_events` (or a position held where the caller may not read to positions)
-- land: a batch from the position to the first tick after `tick` that covers it, made now if
-- none does, opened on the provider (sub_start_position) and read by its SQL (event_sql).
create or replace function pgcascade.next_position_events(
    i_queue_name text, i_consumer text, i_finish_batch int8, i_tick int8, i_position text, i_land bool,
    i_inline_events int8, i_seqs text[], i_listen_ms int8,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8,
    out event_sql text, out events text, out row_counts json, out other_events int8, out seq_values int8[],
    out cur_tick_snapshot text, out pending bool,
    out prev_position text, out cur_position text, out alone bool, out by_ticks bool)
language plpgsql set plan_cache_mode = force_generic_plan set enable_seqscan = off as $$
declare
    q pgcascade.queue;
    s pgcascade.subscription;
    pos pg_snapshot;
    cur pg_snapshot;
    ins pg_lsn;
    seen int8;
    newest int8;
    newest_snap pg_snapshot;
    n_events int8 := 0;
    n_bytes int8 := 0;
    landing int8;
    inline_bytes constant int8 := 8388608;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name;
    if not found then
        raise exception 'queue "%" does not exist', i_queue_name using errcode = 'P0002';
    end if;
    select sub.* into s from pgcascade.subscription sub join pgcascade.consumer c on c.co_id = sub.sub_consumer
     where sub.sub_queue = q.queue_id and c.co_name = i_consumer;
    if not found then
        raise exception 'consumer "%" is not registered on queue "%"', i_consumer, i_queue_name
            using errcode = 'P0002';
    end if;
    prev_tick_id := i_tick;
    prev_position := i_position;
    select t.tick_time, t.tick_event_seq, coalesce(i_position::pg_snapshot, t.tick_snapshot)
      into prev_tick_time, prev_tick_event_seq, pos
      from pgcascade.tick t where t.tick_queue = q.queue_id and t.tick_id = i_tick;
    if not found then
        raise exception 'tick % of consumer "%" on queue "%" no longer exists', i_tick, i_consumer, i_queue_name;
    end if;
    -- an open batch (a landing, or next_batch_events') was applied or not: the caller's record
    -- says which, and the provider follows it (set_consumer_position's rule)
    if s.sub_batch is not null then
        update pgcascade.subscription
           set sub_last_tick = i_tick, sub_next_tick = null, sub_batch = null, sub_start_position = null,
               sub_active = now()
         where sub_id = s.sub_id;
        s.sub_last_tick := i_tick;
        s.sub_active := now();
    end if;
    -- (a branch's queue takes its events with their ticks, one transaction each: nothing there
    -- is between two ticks, and the leaf keeps to them)
    alone := not q.queue_external_ticker
             and not exists (select 1 from pgcascade.subscription o join pgcascade.consumer c on c.co_id = o.sub_consumer
                              where o.sub_queue = q.queue_id and o.sub_id <> s.sub_id and left(c.co_name, 1) <> '.');
    if not i_land and alone then
        -- one statement: the snapshot the events are read by is the one they are read in
        with c as materialized (
            select pg_current_snapshot() as cs, pg_current_wal_insert_lsn() as ins,
                   pg_sequence_last_value(q.queue_event_seq) as seen),
        e as materialized (
            select ev.ev_id, ev.ev_txid, ev.ev_type, ev.ev_data, ev.ev_extra1, ev.ev_rare, ev.ev_time
              from pgcascade.event ev, c
             where ev.ev_part >= q.queue_id * 16 and ev.ev_part < q.queue_id * 16 + 16
               and (ev.ev_txid >= pg_snapshot_xmax(pos)::text::int8 and ev.ev_txid < pg_snapshot_xmax(c.cs)::text::int8
                    or ev.ev_txid = any(array(select x::text::int8 from pg_snapshot_xip(pos) x
                                               where pg_visible_in_snapshot(x, c.cs))))
               and pg_visible_in_snapshot(ev.ev_txid::text::xid8, c.cs)
               and (ev.ev_rare is null or (ev.ev_rare).ev_owner is null or (ev.ev_rare).ev_owner = s.sub_id)
             limit i_inline_events + 1),
        n as (select count(*) as c, coalesce(sum(octet_length(e.ev_data)), 0) as b from e)
        select n.c, n.b,
               case when n.c <= i_inline_events and n.b <= inline_bytes then
                   (select json_agg(json_build_array(e.ev_id, e.ev_txid, e.ev_type, e.ev_data, e.ev_extra1, e.ev_time,
                                                     (e.ev_rare).ev_extra2, (e.ev_rare).ev_extra3, (e.ev_rare).ev_extra4)
                                    order by e.ev_id)::text from e) end,
               (select json_object_agg(g.t, g.n) from (select e.ev_extra1 t, count(*) n from e
                                                        where e.ev_type in ('I', 'U', 'D') group by 1) g),
               (select count(*) from e where coalesce(e.ev_type, '') not in ('I', 'U', 'D')),
               (select c.cs from c), (select c.ins from c), (select c.seen from c),
               (select t.tick_id from pgcascade.tick t where t.tick_queue = q.queue_id order by t.tick_id desc limit 1)
          from n
          into n_events, n_bytes, events, row_counts, other_events, cur, ins, seen, newest;
        cur_tick_event_seq := seen;
        if n_events <= i_inline_events and n_bytes <= inline_bytes then
            -- the provider keeps its history from the caller's record on (rotation, the other
            -- checks): written at most once a second, not at every batch - or now, as the write
            -- whose commit flushes the WAL past the snapshot's transactions: a commit that wrote
            -- no WAL is never flushed, even with a transaction id and synchronous_commit on
            -- (where synchronous standbys are named, it waits for them too, as a tick's does)
            if n_events > 0 and (pg_current_wal_flush_lsn() < ins or current_setting('synchronous_standby_names') <> '') then
                perform set_config('synchronous_commit', 'on', true);
                update pgcascade.subscription set sub_last_tick = i_tick, sub_active = now() where sub_id = s.sub_id;
            elsif s.sub_last_tick <> i_tick or s.sub_active < now() - interval '1 second' then
                update pgcascade.subscription set sub_last_tick = i_tick, sub_active = now() where sub_id = s.sub_id;
            end if;
            select t.tick_snapshot, t.tick_time into newest_snap, cur_tick_time from pgcascade.tick t
             where t.tick_queue = q.queue_id and t.tick_id = newest;
            if n_events = 0 then
                if newest > i_tick and (i_position is null or pgcascade.snapshot_covers(newest_snap, pos)) then
                    -- nothing between the position and the newest tick: an empty batch to it
                    batch_id := 0;
                    cur_tick_id := newest;
                    cur_tick_snapshot := newest_snap::text;
                    events := '[]';
                    row_counts := '{}';
                    other_events := 0;
                    return;
                end if;
                events := null;
                row_counts := null;
                other_events := null;
                cur_tick_time := null;
                if i_listen_ms is not null then
                    pending := pgcascade.position_listens(q, i_listen_ms, seen, cur);
                end if;
                return;
            end if;
            if i_seqs is not null then  -- read after the snapshot: next_batch_events' rule
                seq_values := array(select pg_sequence_last_value(to_regclass(n)) from unnest(i_seqs) with ordinality u(n, o)
                                     order by o);
            end if;
            batch_id := 0;
            cur_tick_id := newest;
            cur_position := cur::text;
            cur_tick_snapshot := cur_position;
            events := coalesce(events, '[]');
            row_counts := coalesce(row_counts, '{}');
            return;
        end if;
        events := null;
        row_counts := null;
        other_events := null;
    end if;
    by_ticks := true;
    if i_position is null then
        return;  -- at a tick already: the caller reads by ticks (several at once, if behind)
    end if;
    -- a landing: the first tick after the caller's that covers its position (made now if none)
    select t.tick_id into landing from pgcascade.tick t
     where t.tick_queue = q.queue_id and t.tick_id > i_tick and pgcascade.snapshot_covers(t.tick_snapshot, pos)
     order by t.tick_id limit 1;
    if landing is null then
        if q.queue_external_ticker or q.queue_ticker_paused then
            return;  -- its ticks come from elsewhere (or are paused): the next one will do
        end if;
        select * into q from pgcascade.queue where queue_id = q.queue_id for update;
        landing := pgcascade.make_tick(q, null, null, null, not alone);
    end if;
    s.sub_batch := nextval('pgcascade.batch_id_seq');
    s.sub_last_tick := i_tick;
    s.sub_next_tick := landing;
    s.sub_start_position := i_position;
    update pgcascade.subscription
       set sub_last_tick = i_tick, sub_next_tick = landing, sub_batch = s.sub_batch,
           sub_start_position = i_position, sub_active = now()
     where sub_id = s.sub_id;
    batch_id := s.sub_batch;
    cur_tick_id := landing;
    select t.tick_time, t.tick_event_seq, t.tick_snapshot::text into cur_tick_time, cur_tick_event_seq, cur_tick_snapshot
      from pgcascade.tick t where t.tick_queue = q.queue_id and t.tick_id = landing;
    event_sql := pgcascade.subscription_batch_sql(s);
end $$;

-- pgcascade.position_listens(queue, wait_ms, seen_event_seq, snapshot) -> whether events may be
-- pending after a position fetch that found none at `snapshot`: consumer_listens' doorbell,
-- set first, then what it cannot ring for - events numbered after the fetch read the event
-- sequence (`seen_event_seq`), or by a transaction in progress at the snapshot (it numbered
-- them before the doorbell was set, so it will not notify its commit).
create or replace function pgcascade.position_listens(
    q pgcascade.queue, i_wait_ms int8, i_seen_event_seq int8, i_snap pg_snapshot) returns bool
language plpgsql set enable_seqscan = off as $$
declare
    lo int4 := q.queue_id * 16;
begin
    if not pgcascade.ring_doorbell(q.queue_id, i_wait_ms) then
        return true;
    end if;
    return coalesce(pg_sequence_last_value(q.queue_event_seq), 0) > coalesce(i_seen_event_seq, 0)
        or exists (select 1 from pg_snapshot_xip(i_snap) x
                    where pg_xact_status(x) is distinct from 'aborted'
                      and exists (select 1 from pgcascade.event ev
                                   where ev.ev_part >= lo and ev.ev_part < lo + 16 and ev.ev_txid = x::text::int8));
end $$;
