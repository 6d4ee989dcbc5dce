-- pgcascade.registration_lock() -> the first key of the advisory lock (second: the queue id) that
-- registrations take exclusively and a two-way master's peer apply shared.
create or replace function pgcascade.registration_lock() returns int4
language sql immutable as $$ select 1885824370 $$;  -- 'pgcr'

-- pgcascade.registration_needs_lock(queue_id, consumer) -> whether registering it takes that lock: a
-- consumer new on the queue, other than the internal registrations ('.global_watermark', ...).
create or replace function pgcascade.registration_needs_lock(i_queue_id int4, i_consumer text) returns bool
language sql stable as $$
    select left(i_consumer, 1) <> '.'
       and not exists (select 1 from pgcascade.subscription s join pgcascade.consumer c on c.co_id = s.sub_consumer
                        where s.sub_queue = i_queue_id and c.co_name = i_consumer)
$$;

-- pgcascade.register_consumer(queue, consumer) -> 1 if registered now, 0 if it already was.
-- A new consumer starts at the queue's last tick: it receives events committed after it.
create or replace function pgcascade.register_consumer(i_queue_name text, i_consumer text) returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    v_tick int8;
begin
    q := pgcascade.find_queue(i_queue_name);
    -- a two-way master passes its peers' changes on only while a consumer other than its peers
    -- is registered (pgcascade.peer_apply_begin): once no apply that passed nothing on is in
    -- flight, a new tick is the first position that misses none of them
    if pgcascade.registration_needs_lock(q.queue_id, i_consumer) then
        perform pg_advisory_xact_lock(pgcascade.registration_lock(), q.queue_id);
        if exists (select 1 from pgcascade.node where peer_of = i_queue_name) then
            perform pgcascade.ticker(i_queue_name);
        end if;
    end if;
    select max(tick_id) into v_tick from pgcascade.tick where tick_queue = q.queue_id;
    if v_tick is null then
        raise exception 'queue "%" has no tick yet', i_queue_name using errcode = '55000';
    end if;
    return pgcascade.register_consumer_at(i_queue_name, i_consumer, v_tick, false);
end $$;

-- pgcascade.register_consumer_at(queue, consumer, tick_id, move default true) -> 1 new, 0 moved/kept.
-- Registers a consumer at a given tick, or moves an existing registration there.  A
-- registration that never reads batches is a watermark: rotation and tick cleanup wait
-- behind it (the cascade keeps its global watermark this way).
create or replace function pgcascade.register_consumer_at(
    i_queue_name text, i_consumer text, i_tick_id int8, i_move bool default true)
returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    v_co int4;
    s pgcascade.subscription;
begin
    if i_consumer is null or btrim(i_consumer) = '' then
        raise exception 'consumer name must not be empty' using errcode = '22023';
    end if;
    q := pgcascade.find_queue(i_queue_name);
    if pgcascade.registration_needs_lock(q.queue_id, i_consumer) then
        perform pg_advisory_xact_lock(pgcascade.registration_lock(), q.queue_id);
    end if;
    perform 1 from pgcascade.tick where tick_queue = q.queue_id and tick_id = i_tick_id;
    if not found then
        raise exception 'tick % does not exist on queue "%"', i_tick_id, i_queue_name using errcode = 'P0002';
    end if;
    insert into pgcascade.consumer (co_name) values (i_consumer) on conflict (co_name) do nothing;
    select co_id into v_co from pgcascade.consumer where co_name = i_consumer;
    select * into s from pgcascade.subscription where sub_queue = q.queue_id and sub_consumer = v_co for update;
    if not found then
        insert into pgcascade.subscription (sub_queue, sub_consumer, sub_last_tick)
        values (q.queue_id, v_co, i_tick_id);
        return 1;
    end if;
    if i_move then
        if s.sub_batch is not null then
            raise exception 'consumer "%" has an open batch on queue "%": finish it first', i_consumer, i_queue_name
                using errcode = '55000';
        end if;
        update pgcascade.subscription set sub_last_tick = i_tick_id, sub_active = now() where sub_id = s.sub_id;
    end if;
    return 0;
end $$;

-- pgcascade.unregister_consumer(queue, consumer) -> 1.
-- Drops the registration and its retry events; rotation no longer waits for it.
create or replace function pgcascade.unregister_consumer(i_queue_name text, i_consumer text) returns int4
language plpgsql as $$
declare
    s pgcascade.subscription;
begin
    s := pgcascade.find_subscription(i_queue_name, i_consumer, true);
    delete from pgcascade.subscription where sub_id = s.sub_id;
    return 1;
end $$;

-- pgcascade.set_consumer_position(queue, consumer, tick_id) -> 1: closes the consumer's open
-- batch, if any, and puts it at tick_id.  A subscriber calls it when its own durable record
-- of what it applied differs from the position the provider has for it (the provider lost a
-- finish_batch in a crash, say): the subscriber's record wins.  The tick must still exist.
create or replace function pgcascade.set_consumer_position(i_queue_name text, i_consumer text, i_tick_id int8)
returns int4
language plpgsql as $$
declare
    s pgcascade.subscription;
begin
    s := pgcascade.find_subscription(i_queue_name, i_consumer, true);
    perform 1 from pgcascade.tick where tick_queue = s.sub_queue and tick_id = i_tick_id;
    if not found then
        raise exception 'tick % of queue "%" no longer exists: consumer "%" cannot resume there (resync needed)',
            i_tick_id, i_queue_name, i_consumer using errcode = 'P0002';
    end if;
    update pgcascade.subscription
       set sub_last_tick = i_tick_id, sub_batch = null, sub_next_tick = null, sub_start_position = null,
           sub_active = now()
     where sub_id = s.sub_id;
    return 1;
end $$;
