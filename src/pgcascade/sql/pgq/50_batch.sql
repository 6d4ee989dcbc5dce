-- pgcascade.batch_end(subscription, prev_event_seq, max_events, max_tick) -> the tick the next
-- batch of a consumer without an open batch ends at (null: none follows its position yet): the
-- next tick, or - with max_events - the furthest tick within about max_events events of the
-- position (`prev_event_seq`: its tick's event counter), never past max_tick.
create or replace function pgcascade.batch_end(
    s pgcascade.subscription, i_prev_event_seq int8, i_max_events int8, i_max_tick int8) returns int8
language plpgsql stable as $$
declare
    v_next int8;
    v_far int8;
begin
    -- ORDER BY ... LIMIT 1, not min()/max(): those plans do not depend on the statistics of
    -- the moment (30_ticker.sql)
    select t.tick_id into v_next from pgcascade.tick t
     where t.tick_queue = s.sub_queue and t.tick_id > s.sub_last_tick order by t.tick_id limit 1;
    if v_next is not null and i_max_events is not null then
        select t.tick_id into v_far from pgcascade.tick t
         where t.tick_queue = s.sub_queue and t.tick_id > v_next
           and t.tick_id <= coalesce(i_max_tick, t.tick_id)
           and t.tick_event_seq <= i_prev_event_seq + i_max_events
         order by t.tick_id desc limit 1;
        v_next := greatest(v_next, v_far);
    end if;
    return v_next;
end $$;

-- pgcascade.next_batch_custom(queue, consumer, max_events, max_tick) -> the consumer's open
-- batch, opening the next one:
--   batch_id            null when no tick follows the consumer's position yet
--   cur_tick_id, prev_tick_id, cur_tick_time, prev_tick_time, cur_tick_event_seq, prev_tick_event_seq
-- A batch spans one tick interval, or - for a consumer that is behind and gives max_events -
-- as many consecutive intervals as hold about max_events events, never past max_tick.
-- Calling it again before finish_batch returns the same batch (a consumer that crashed
-- resumes the batch it had).
create or replace function pgcascade.next_batch_custom(
    i_queue_name text, i_consumer text, i_max_events int8, i_max_tick int8,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8)
language plpgsql set enable_seqscan = off as $$
declare
    s pgcascade.subscription;
    v_next int8;
begin
    s := pgcascade.find_subscription(i_queue_name, i_consumer, true);
    select t.tick_time, t.tick_event_seq into prev_tick_time, prev_tick_event_seq
      from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = s.sub_last_tick;
    if not found then
        raise exception 'tick % of consumer "%" on queue "%" no longer exists', s.sub_last_tick, i_consumer, i_queue_name;
    end if;
    if s.sub_batch is null and (i_max_tick is null or i_max_tick > s.sub_last_tick) then
        v_next := pgcascade.batch_end(s, prev_tick_event_seq, i_max_events, i_max_tick);
        if v_next is not null then
            s.sub_batch := nextval('pgcascade.batch_id_seq');
            s.sub_next_tick := v_next;
            update pgcascade.subscription set sub_batch = s.sub_batch, sub_next_tick = v_next, sub_active = now()
             where sub_id = s.sub_id;
        end if;
    end if;
    if s.sub_batch is null then
        update pgcascade.subscription set sub_active = now() where sub_id = s.sub_id;
    end if;
    batch_id := s.sub_batch;
    prev_tick_id := s.sub_last_tick;
    cur_tick_id := s.sub_next_tick;
    if cur_tick_id is not null then
        select t.tick_time, t.tick_event_seq into cur_tick_time, cur_tick_event_seq
          from pgcascade.tick t where t.tick_queue = s.sub_queue and t.tick_id = cur_tick_id;
    end if;
end $$;

-- pgcascade.next_batch_info(queue, consumer) -> the next one-tick batch (see next_batch_custom).
-- One tick interval per batch, so every node of a cascade cuts identical batches.
create or replace function pgcascade.next_batch_info(
    i_queue_name text, i_consumer text,
    out batch_id int8, out cur_tick_id int8, out prev_tick_id int8,
    out cur_tick_time timestamptz, out prev_tick_time timestamptz,
    out cur_tick_event_seq int8, out prev_tick_event_seq int8)
language sql as $$
    select * from pgcascade.next_batch_custom(i_queue_name, i_consumer, null, null)
$$;

-- pgcascade.next_batch(queue, consumer) -> batch_id, or null when there is no new tick.
create or replace function pgcascade.next_batch(i_queue_name text, i_consumer text) returns int8
language sql as $$ select batch_id from pgcascade.next_batch_info(i_queue_name, i_consumer) $$;

-- pgcascade.get_batch_info(batch_id) -> what the batch spans.
create or replace function pgcascade.get_batch_info(
    i_batch_id int8,
    out queue_name text, out consumer_name text,
    out prev_tick_id int8, out tick_id int8,
    out prev_tick_time timestamptz, out tick_time timestamptz, out lag interval,
    out prev_event_seq int8, out event_seq int8)
language plpgsql as $$
begin
    select q.queue_name, c.co_name, s.sub_last_tick, s.sub_next_tick,
           pt.tick_time, ct.tick_time, now() - ct.tick_time, pt.tick_event_seq, ct.tick_event_seq
      into queue_name, consumer_name, prev_tick_id, tick_id, prev_tick_time, tick_time, lag,
           prev_event_seq, event_seq
      from pgcascade.subscription s
      join pgcascade.queue q on q.queue_id = s.sub_queue
      join pgcascade.consumer c on c.co_id = s.sub_consumer
      join pgcascade.tick pt on pt.tick_queue = s.sub_queue and pt.tick_id = s.sub_last_tick
      join pgcascade.tick ct on ct.tick_queue = s.sub_queue and ct.tick_id = s.sub_next_tick
     where s.sub_batch = i_batch_id;
    if not found then
        raise exception 'batch % is not open (finished already, or never existed)', i_batch_id
            using errcode = 'P0002';
    end if;
end $$;

-- pgcascade.subscription_batch_sql(subscription) -> the SELECT that returns the events of the
-- subscription's open batch, ordered by ev_id.  An event belongs to the batch when its
-- transaction is visible in the batch's closing tick snapshot and not in the opening one.  Not visible in the opening snapshot means: txid at or
-- above its xmax, or in its in-progress list - two index range scans on ev_txid, however
-- long-running the oldest open transaction is.  Every partition of the queue is read, so a
-- writer that still used the previous partition after a rotation is never missed.
create or replace function pgcascade.subscription_batch_sql(s pgcascade.subscription) returns text
language plpgsql as $$
declare
    prev_snap pg_snapshot;
    cur_snap pg_snapshot;
    cols text;
    cond text;
    sql text;
    xip int8[];
begin
    -- (a landing batch starts at the consumer's position, not at its tick: 53_position.sql)
    select coalesce(s.sub_start_position::pg_snapshot, tick_snapshot) into prev_snap
      from pgcascade.tick where tick_queue = s.sub_queue and tick_id = s.sub_last_tick;
    select tick_snapshot into cur_snap from pgcascade.tick where tick_queue = s.sub_queue and tick_id = s.sub_next_tick;
    cols := 'ev_id, ev_time, ev_txid, (ev_rare).ev_retry as ev_retry, ev_type, ev_data,'
         || ' ev_extra1, (ev_rare).ev_extra2 as ev_extra2, (ev_rare).ev_extra3 as ev_extra3,'
         || ' (ev_rare).ev_extra4 as ev_extra4 from pgcascade.event';
    cond := format(' ev_part >= %s and ev_part < %s', s.sub_queue * 16, s.sub_queue * 16 + 16)
         || format(' and txid_visible_in_snapshot(ev_txid, %L::txid_snapshot)', cur_snap)
         || format(' and (ev_rare is null or (ev_rare).ev_owner is null or (ev_rare).ev_owner = %s)', s.sub_id);
    sql := format('select %s where %s and ev_txid >= %s and ev_txid < %s',
                  cols, cond, pg_snapshot_xmax(prev_snap)::text, pg_snapshot_xmax(cur_snap)::text);
    -- transactions in progress at the earlier tick that ended by the later one; one still in
    -- progress has no event in the batch, and probing its events (a long transaction may have
    -- millions) at every batch would cost the provider more the longer it runs
    select array_agg(x::text::int8) into xip from pg_snapshot_xip(prev_snap) x where pg_visible_in_snapshot(x, cur_snap);
    if xip is not null then
        sql := sql || format(' union all select %s where %s and ev_txid = any(%L::int8[])', cols, cond, xip);
    end if;
    -- readers that store the events drop this last clause (pgq/queue.py, unordered)
    return sql || ' order by 1';
end $$;

-- pgcascade.batch_event_sql(batch_id) -> the SELECT of the batch's events (next_batch_events,
-- which holds the subscription's row, asks subscription_batch_sql: the subscription table has
-- no index on sub_batch, and the lookup cost ~5 ms a call at 100 batches a second).  PL/pgSQL,
-- never inlined: next_batch's statement opens the batch and asks for its SELECT, and an inlined
-- lookup would read the subscription with that statement's snapshot, from before the batch.
create or replace function pgcascade.batch_event_sql(i_batch_id int8) returns text
language plpgsql as $$
begin
    return pgcascade.subscription_batch_sql(pgcascade.find_batch(i_batch_id));
end $$;

-- pgcascade.get_batch_events(batch_id) -> setof events (ev_id, ev_time, ev_txid, ev_retry, ev_type,
-- ev_data, ev_extra1..4), as PgQ returns them.  The Python API streams batch_event_sql()
-- through a server-side cursor instead, so a huge batch is never materialized.
create or replace function pgcascade.get_batch_events(
    i_batch_id int8,
    out ev_id int8, out ev_time timestamptz, out ev_txid int8, out ev_retry int4, out ev_type text,
    out ev_data text, out ev_extra1 text, out ev_extra2 text, out ev_extra3 text, out ev_extra4 text)
returns setof record
language plpgsql as $$
begin
    return query execute pgcascade.batch_event_sql(i_batch_id);
end $$;

-- pgcascade.finish_batch(batch_id) -> 1: the consumer has processed the batch; it moves to
-- the batch's closing tick.  Finishing a batch that is not open is an error.
create or replace function pgcascade.finish_batch(i_batch_id int8) returns int4
language plpgsql as $$
begin
    update pgcascade.subscription
       set sub_last_tick = sub_next_tick, sub_next_tick = null, sub_batch = null, sub_start_position = null,
           sub_active = now()
     where sub_batch = i_batch_id;
    if not found then
        raise exception 'batch % is not open (finished already, or never existed)', i_batch_id
            using errcode = 'P0002';
    end if;
    return 1;
end $$;
